"""Chat examples: prompt masking, padding (attention mask), packing whole documents."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchbook.chat import (
    IGNORE_INDEX,
    ChatTemplate,
    PadCollate,
    chat_example,
    greedy_answers_correct,
    pack_documents,
    render_chat,
)
from torchbook.models import GPT, GPTConfig


def char_encode(text):
    """A stand-in tokenizer: one id per character, so positions are easy to follow."""
    return [ord(c) for c in text]


MESSAGES = [
    {"role": "user", "content": "Who's there?"},
    {"role": "assistant", "content": "Nay, answer me."},
    {"role": "user", "content": "Long live the king!"},
    {"role": "assistant", "content": "Bernardo?"},
]


def test_input_ids_spell_the_rendered_conversation():
    example = chat_example(MESSAGES, char_encode)
    assert "".join(map(chr, example["input_ids"])) == render_chat(MESSAGES)


def test_only_assistant_answers_and_their_end_marker_are_learned():
    template = ChatTemplate()
    example = chat_example(MESSAGES, char_encode, template)
    learned = "".join(chr(t) for t in example["labels"] if t != IGNORE_INDEX)
    expected = "".join(
        m["content"] + template.end for m in MESSAGES if m["role"] == "assistant"
    )
    assert learned == expected
    kept = [
        i
        for i, t in zip(example["input_ids"], example["labels"], strict=True)
        if t != IGNORE_INDEX
    ]
    assert kept == [t for t in example["labels"] if t != IGNORE_INDEX], (
        "labels are not the tokens they sit on"
    )


def test_unknown_role_is_refused_with_its_position():
    with pytest.raises(ValueError, match="message 1: role 'system'"):
        chat_example([MESSAGES[0], {"role": "system", "content": "x"}], char_encode)


def test_rendering_refuses_an_unknown_role_with_its_position():
    with pytest.raises(ValueError, match="message 1: role 'system'"):
        render_chat([MESSAGES[0], {"role": "system", "content": "x"}])


def test_padding_goes_on_the_right_with_no_label_and_no_attention_mask():
    examples = [
        chat_example(MESSAGES[:2], char_encode),
        chat_example(MESSAGES[2:], char_encode),
    ]
    batch = PadCollate(pad_id=0)(examples)
    lengths = [len(e["input_ids"]) for e in examples]
    # a mask that no model reads is not built: right padding needs none
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (2, max(lengths))
    for row, example in enumerate(examples):
        n = lengths[row]
        assert batch["input_ids"][row, :n].tolist() == example["input_ids"]
        assert batch["labels"][row, :n].tolist() == example["labels"]
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all() and (
            batch["input_ids"][row, n:] == 0
        ).all()


def test_right_padded_causal_logits_of_real_tokens_equal_the_logits_alone():
    # why PadCollate needs no attention mask: a causal model's real tokens never
    # attend to the pads that follow them
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=128, block_size=96, n_layer=2, n_head=2, d_model=32)
    ).eval()
    examples = [
        chat_example(MESSAGES[:2], char_encode),
        chat_example(MESSAGES[2:], char_encode),
    ]
    batch = PadCollate(pad_id=0)(examples)
    with torch.no_grad():
        padded = model(batch["input_ids"])
        for row, example in enumerate(examples):
            alone = model(torch.tensor([example["input_ids"]]))[0]
            # 1e-5: the same weights and tokens; only float32 summation order
            # over a longer row differs (masked keys weigh exactly 0)
            torch.testing.assert_close(
                padded[row, : len(alone)], alone, atol=1e-5, rtol=0
            )


def test_greedy_answers_correct_marks_the_examples_whose_every_target_is_argmax():
    examples = documents((3, 4, 2))
    packed = pack_documents(examples, row_length=10)
    targets = packed["targets"]
    vocab = 50
    # logits whose argmax is the target everywhere ...
    logits = torch.zeros(*targets.shape, vocab)
    learned = targets != IGNORE_INDEX
    logits[learned.nonzero(as_tuple=True) + (targets[learned],)] = 1.0
    right = greedy_answers_correct(logits, targets, packed["document_ids"])
    assert right.tolist() == [True, True, True]
    # ... then one wrong token in example 1 makes it, and only it, wrong
    row, column = (packed["document_ids"] == 1).nonzero()[0].tolist()
    logits[row, column, (targets[row, column] + 1) % vocab] = 2.0
    wrong = greedy_answers_correct(logits, targets, packed["document_ids"])
    assert wrong.tolist() == [True, False, True]


def documents(lengths, seed=0, vocab_size=50):
    """Plain documents of given lengths: every token is learned (labels = input_ids)."""
    generator = torch.Generator().manual_seed(seed)
    ids = [
        torch.randint(0, vocab_size, (n,), generator=generator).tolist()
        for n in lengths
    ]
    return [{"input_ids": d, "labels": d} for d in ids]


def test_pack_documents_keeps_examples_whole_positions_from_0_next_token_targets():
    examples = [
        chat_example(MESSAGES[:2], char_encode),
        chat_example(MESSAGES[2:], char_encode),
    ] + documents((9, 30))
    packed = pack_documents(examples, row_length=100)
    for index, example in enumerate(examples):
        row, columns = (packed["document_ids"] == index).nonzero(as_tuple=True)
        n = len(example["input_ids"])
        assert len(set(row.tolist())) == 1 and columns.tolist() == list(
            range(columns[0], columns[0] + n)
        )
        at = (row[0], columns)
        assert packed["tokens"][at].tolist() == example["input_ids"]
        assert packed["position_ids"][at].tolist() == list(range(n))
        # The target of a token is the next token's label; the last token's next token
        # is another example's.
        assert packed["targets"][at].tolist() == example["labels"][1:] + [IGNORE_INDEX]


def test_pack_documents_fills_rows_first_fit_and_pads_the_rest():
    packed = pack_documents(documents((6, 5, 3, 4)), row_length=10, pad_id=7)
    # First fit: 6 and 3 share the first row, 5 and 4 the second; one pad ends each.
    assert packed["document_ids"].tolist() == [
        [0] * 6 + [2] * 3 + [-1],
        [1] * 5 + [3] * 4 + [-1],
    ]
    padding = packed["document_ids"] == -1
    assert (packed["tokens"][padding] == 7).all() and (
        packed["targets"][padding] == IGNORE_INDEX
    ).all()


def test_pack_documents_refuses_an_example_longer_than_a_row_naming_it():
    with pytest.raises(
        ValueError, match=r"example 1 has 12 tokens, more than row_length=10"
    ):
        pack_documents(documents((4, 12)), row_length=10)


@pytest.mark.parametrize("position", [0, 2])
def test_pack_documents_refuses_an_empty_example_naming_it(position):
    # At the start of a row (position 0) an empty example raised a shape
    # RuntimeError; later in a row it became a document of no tokens.
    examples = documents((4, 3))
    examples.insert(position, {"input_ids": [], "labels": []})
    with pytest.raises(ValueError, match=rf"example {position} has no tokens"):
        pack_documents(examples, row_length=4)


def per_document_losses(
    lengths=(7, 12, 5, 9, 3), row_length=16, mask=True, restart_positions=True
):
    """Each document's mean loss by a small GPT, packed (mask or not) and alone."""
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=50, block_size=row_length, n_layer=2, n_head=2, d_model=32)
    ).eval()
    examples = documents(lengths)
    packed = pack_documents(examples, row_length=row_length)
    document_ids = packed["document_ids"] if mask else None
    # None: positions 0 .. row_length-1 run on across the row
    position_ids = packed["position_ids"] if restart_positions else None
    logits = model(
        packed["tokens"], position_ids=position_ids, document_ids=document_ids
    )
    token_losses = F.cross_entropy(
        logits.flatten(0, 1), packed["targets"].flatten(), reduction="none"
    )
    packed_losses, alone_losses = [], []
    for index, example in enumerate(examples):
        learned = (packed["document_ids"].flatten() == index) & (
            packed["targets"].flatten() != IGNORE_INDEX
        )
        packed_losses.append(token_losses[learned].mean())
        ids = torch.tensor([example["input_ids"]])
        alone_losses.append(F.cross_entropy(model(ids)[0, :-1], ids[0, 1:]))
    return torch.stack(packed_losses), torch.stack(alone_losses)


def test_each_documents_loss_packed_equals_its_loss_alone():
    packed, alone = per_document_losses()
    # 1e-6: masked keys weigh exactly 0, so only float32 summation order differs
    # (SDPA over a longer row with a mask), a few ulps of losses near log(50) = 3.9.
    torch.testing.assert_close(packed, alone, atol=1e-6, rtol=0)


def test_with_rope_and_the_mask_positions_running_on_across_the_row_change_no_loss():
    # RoPE scores depend on the distance between positions, which the offset of a
    # document in its row does not change. 1e-6 (as above): rotations by larger
    # angles round differently in float32, a few ulps of losses near 3.9; tables
    # that are not rotations (absolute positions) move these losses by ~5e-5.
    running, alone = per_document_losses(restart_positions=False)
    torch.testing.assert_close(running, alone, atol=1e-6, rtol=0)
    # the check can fail: without the mask, running positions do change the losses
    unmasked, _ = per_document_losses(mask=False, restart_positions=False)
    assert (unmasked - alone).abs().max() > 1e-4


def test_without_the_document_mask_every_document_after_the_first_in_its_row_changes():
    packed, alone = per_document_losses(mask=False)
    # First fit in rows of 16: 7, 5 and 3 share row 0; 12 opens row 1;
    # 9 (4 left in each) opens row 2.
    starts_a_row = torch.tensor([True, True, False, True, False])
    gap = (packed - alone).abs()
    assert (gap[starts_a_row] < 1e-6).all(), gap  # nothing before them to see
    # they attend to the documents before them
    assert (gap[~starts_a_row] > 1e-4).all(), gap


def test_collate_output_trains_only_on_answers():
    # cross_entropy with the -100 labels equals the mean loss over answer tokens alone
    examples = [
        chat_example(MESSAGES[:2], char_encode),
        chat_example(MESSAGES[2:], char_encode),
    ]
    batch = PadCollate(pad_id=0)(examples)
    logits = torch.randn(
        *batch["labels"].shape, 128, generator=torch.Generator().manual_seed(0)
    )
    labels = batch["labels"]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    keep = labels.flatten() != IGNORE_INDEX
    by_hand = (
        -logits.flatten(0, 1)[keep]
        .log_softmax(-1)
        .gather(1, labels.flatten()[keep, None])
        .mean()
    )
    # same float32 ops, default tolerance is ample
    torch.testing.assert_close(loss, by_hand)


# -- the Hugging Face form: PreTrainedTokenizerFast and apply_chat_template ----------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from torchbook.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(
        "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 30
    )
    return train_bpe([path], vocab_size=300)


CONVERSATION = [
    # quotes, braces and a newline pass through unchanged
    {
        "role": "user",
        "content": "What's {{ this }}?\n",
    },
    {"role": "assistant", "content": "A 'test'."},
    {"role": "user", "content": "Again"},
    {"role": "assistant", "content": "Yes"},
]


def test_apply_chat_template_renders_what_render_chat_renders(trained):
    from torchbook.hf import hf_tokenizer

    wrapped = hf_tokenizer(trained)
    assert wrapped.apply_chat_template(CONVERSATION, tokenize=False) == render_chat(
        CONVERSATION
    )


def test_apply_chat_template_ids_are_the_book_tokenizers_ids(trained):
    from torchbook.hf import hf_tokenizer

    ids = hf_tokenizer(trained).apply_chat_template(CONVERSATION, tokenize=True)[
        "input_ids"
    ]
    assert ids == trained.encode(render_chat(CONVERSATION)).ids


def test_generation_prompt_ends_with_the_assistant_marker(trained):
    from torchbook.hf import hf_tokenizer

    text = hf_tokenizer(trained).apply_chat_template(
        CONVERSATION[:1], tokenize=False, add_generation_prompt=True
    )
    assert text == render_chat(CONVERSATION[:1]) + ChatTemplate().assistant


def test_saved_tokenizer_reloads_with_its_chat_template(trained, tmp_path):
    from transformers import AutoTokenizer

    from torchbook.hf import hf_tokenizer

    hf_tokenizer(trained).save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").exists()
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.apply_chat_template(CONVERSATION, tokenize=False) == render_chat(
        CONVERSATION
    )


def test_chat_template_refuses_an_unknown_role(trained):
    from jinja2.exceptions import TemplateError

    from torchbook.hf import hf_tokenizer

    with pytest.raises(TemplateError, match="message 1: role system"):
        hf_tokenizer(trained).apply_chat_template(
            [CONVERSATION[0], {"role": "system", "content": "x"}], tokenize=False
        )


def test_wrapping_a_tokenizer_without_the_chat_tokens_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    from torchbook.hf import hf_tokenizer

    with pytest.raises(ValueError, match="lacks the special token"):
        hf_tokenizer(Tokenizer(models.BPE()))
