"""code/torchbook/book/stand_in.py: a hub-style folder, and it learned."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from torchbook.book.profiles import PretrainedSizes
from torchbook.book.stand_in import make_stand_in
from torchbook.hf_checkpoint import load_pretrained
from torchbook.tokenizer import train_bpe

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n\n"
) * 40
TINY = PretrainedSizes(
    d_model=32,
    n_layer=2,
    n_head=4,
    n_kv_head=2,
    mlp_size=64,
    max_positions=64,
    batch_size=8,
    steps=40,
    lr=1e-2,
    max_shard_bytes=40_000,
)


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stand-in")
    (folder / "text.txt").write_text(TEXT)
    tokenizer = train_bpe([folder / "text.txt"], vocab_size=300)
    result = make_stand_in(
        folder / "model", tokenizer, TEXT, TINY, torch.device("cpu"), seed=0
    )
    return tokenizer, result


def test_the_folder_is_sharded_with_an_index_and_a_tokenizer(stand_in):
    _, result = stand_in
    folder = result.folder
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()


def test_the_stand_in_learned_the_text(stand_in):
    tokenizer, result = stand_in
    # It starts near uniform, log(300) = 5.7 nats, and a text that repeats three
    # speeches is learned to well under half of that in 40 steps at this rate.
    assert abs(result.losses[0] - math.log(tokenizer.get_vocab_size())) < 0.5
    assert sum(result.losses[-5:]) / 5 < result.losses[0] / 2


def test_the_book_and_transformers_read_the_folder_alike(stand_in):
    tokenizer, result = stand_in
    model = load_pretrained(result.folder).eval()
    reference = transformers.LlamaForCausalLM.from_pretrained(result.folder).eval()
    wrapped = transformers.AutoTokenizer.from_pretrained(result.folder)
    ids = wrapped("All:\nSpeak, speak.", return_tensors="pt").input_ids
    assert ids[0].tolist() == tokenizer.encode("All:\nSpeak, speak.").ids
    with torch.no_grad():
        # float32, the same operations: a few ulps apart (see test_hf_checkpoint)
        torch.testing.assert_close(
            model(ids), reference(ids).logits, atol=1e-5, rtol=1e-5
        )
