"""Tests for torchbook.models and torchbook.decoder.

Shapes, causality, attention, packing, generation; also tied weights,
buffers and activation checkpointing.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchbook.decoder import (
    INIT_STD,
    ROPE_BASE,
    apply_rope,
    check_token_ids,
    document_causal_mask,
    masked_softmax_attention,
    rope_tables,
)
from torchbook.memory.measure import saved_activation_bytes
from torchbook.models import GPT, GPTConfig, TinyMLP, count_parameters

# Small enough that every test runs in well under a second on 2 CPU cores.
CONFIG = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=4, d_model=32)
# float32 results that differ only in summation order (fused SDPA kernel against
# matmul + softmax, or a shorter sequence against a longer one) agree to a few
# ulps of values of order 1; 1e-6 leaves room for that and nothing more.
FLOAT32_ATOL = 1e-6


def make_model(config: GPTConfig = CONFIG, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config).eval()


def random_tokens(
    batch: int, steps: int, seed: int = 1, vocab_size: int = CONFIG.vocab_size
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, steps), generator=generator)


def gpt_parameter_formula(c: GPTConfig) -> int:
    """Parameters of the GPT counted by hand, the tied embedding/head once."""
    d = c.d_model
    layer_norm = 2 * d  # weight and bias
    # qkv and output projection, with biases
    attention = (d * 3 * d + 3 * d) + (d * d + d)
    mlp = (d * 4 * d + 4 * d) + (4 * d * d + d)
    per_block = 2 * layer_norm + attention + mlp
    # embedding (= head), blocks, final LN
    return c.vocab_size * d + c.n_layer * per_block + layer_norm


def test_tiny_mlp_maps_a_batch_of_64_features_to_10_logits():
    out = TinyMLP(64, 256, 10)(torch.randn(32, 64))
    assert out.shape == (32, 10)


def test_tiny_mlp_is_the_tutorial_version_with_a_gelu_module():
    model = TinyMLP(64, 256, 10)
    assert isinstance(model.act, torch.nn.GELU)
    x = torch.randn(5, 64)
    by_hand = F.linear(
        F.gelu(F.linear(x, model.fc1.weight, model.fc1.bias)),
        model.fc2.weight,
        model.fc2.bias,
    )
    # Exact: the same float32 operations in the same order.
    assert torch.equal(model(x), by_hand)


def test_tiny_mlp_parameter_count_matches_hand_formula():
    assert count_parameters(TinyMLP(64, 256, 10)) == 64 * 256 + 256 + 256 * 10 + 10


def test_gpt_logits_have_shape_batch_time_vocab():
    logits = make_model()(random_tokens(3, 11))
    assert logits.shape == (3, 11, CONFIG.vocab_size)
    assert logits.dtype == torch.float32


def test_gpt_parameter_count_counts_tied_head_once_and_matches_hand_formula():
    model = make_model()
    assert model.lm_head.weight is model.token_embedding.weight
    assert count_parameters(model) == gpt_parameter_formula(CONFIG)
    # Counting every name separately would count the shared matrix twice.
    by_name = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert by_name == gpt_parameter_formula(CONFIG) + CONFIG.vocab_size * CONFIG.d_model


def test_count_parameters_skips_frozen_unless_asked():
    model = make_model()
    model.token_embedding.requires_grad_(False)
    frozen = CONFIG.vocab_size * CONFIG.d_model
    assert count_parameters(model) == gpt_parameter_formula(CONFIG) - frozen
    assert count_parameters(model, trainable_only=False) == gpt_parameter_formula(
        CONFIG
    )


def test_changing_later_tokens_leaves_earlier_logits_unchanged():
    model = make_model()
    idx = random_tokens(2, CONFIG.block_size)
    t = 6
    changed = idx.clone()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 1) % CONFIG.vocab_size
    full, full_changed = model(idx), model(changed)
    # Independent check: fed only the prefix 0..t, the model agrees at positions <= t.
    prefix_only = model(idx[:, : t + 1])
    torch.testing.assert_close(full[:, : t + 1], prefix_only, atol=FLOAT32_ATOL, rtol=0)
    torch.testing.assert_close(
        full_changed[:, : t + 1], prefix_only, atol=FLOAT32_ATOL, rtol=0
    )
    # And the change is visible where it should be, so the test can fail.
    assert not torch.allclose(full[:, t + 1 :], full_changed[:, t + 1 :])


def test_causal_mask_buffer_is_lower_triangular():
    mask = make_model().causal_mask
    rows = torch.arange(CONFIG.block_size)[:, None]
    cols = torch.arange(CONFIG.block_size)[None, :]
    assert mask.dtype == torch.bool
    assert torch.equal(mask, cols <= rows)


def test_sdpa_is_causal_equals_masked_softmax_attention():
    model = make_model()
    generator = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(
        3, 2, CONFIG.n_head, CONFIG.block_size, CONFIG.head_size, generator=generator
    )
    fused = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    reference = masked_softmax_attention(q, k, v, model.causal_mask)
    torch.testing.assert_close(fused, reference, atol=FLOAT32_ATOL, rtol=0)


def test_masked_softmax_attention_matches_a_per_position_loop():
    generator = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(3, 1, 1, 5, 4, generator=generator)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    out = masked_softmax_attention(q, k, v, mask)
    # position t averages the values at 0..t, weighted by softmax of its scores
    for t in range(5):
        weights = torch.softmax(q[0, 0, t] @ k[0, 0, : t + 1].T / math.sqrt(4), dim=-1)
        torch.testing.assert_close(
            out[0, 0, t], weights @ v[0, 0, : t + 1], atol=FLOAT32_ATOL, rtol=0
        )


def test_apply_rope_rotates_each_feature_pair_by_position_times_its_frequency():
    head_size, block_size = 8, 12
    cos, sin = rope_tables(head_size, block_size)
    x = torch.randn(
        1, 1, block_size, head_size, generator=torch.Generator().manual_seed(4)
    )
    rotated = apply_rope(x, cos, sin)
    half = head_size // 2
    for t in (0, 1, block_size - 1):
        # pair i is features (i, i + half), turned by t * base**(-2i / head_size)
        for i in range(half):
            angle = t * ROPE_BASE ** (-2 * i / head_size)
            a, b = x[0, 0, t, i].item(), x[0, 0, t, i + half].item()
            expected = (
                a * math.cos(angle) - b * math.sin(angle),
                a * math.sin(angle) + b * math.cos(angle),
            )
            got = (rotated[0, 0, t, i].item(), rotated[0, 0, t, i + half].item())
            # 1e-5: float32 angles up to 11 rad are off by ~1e-6 (one ulp of 11) from
            # float64 by hand.
            assert got == pytest.approx(expected, abs=1e-5)


def test_rope_scores_depend_only_on_the_distance_between_positions():
    head_size, block_size = 16, 40
    cos, sin = rope_tables(head_size, block_size)
    generator = torch.Generator().manual_seed(5)
    q_vector, k_vector = torch.randn(2, head_size, generator=generator)
    # The same query and key vectors placed at every position.
    q = apply_rope(q_vector.expand(1, 1, block_size, head_size), cos, sin)[0, 0]
    k = apply_rope(k_vector.expand(1, 1, block_size, head_size), cos, sin)[0, 0]
    distance = 3
    scores = [q[m + distance] @ k[m] for m in range(block_size - distance)]
    # 1e-4: float32 angles up to 39 rad are off by ~4e-6; a score sums head_size
    # products of order 1.
    torch.testing.assert_close(
        torch.stack(scores), scores[0].expand(len(scores)), atol=1e-4, rtol=0
    )
    # other distances differ
    assert not torch.allclose(q[distance] @ k[0], q[distance + 1] @ k[0], atol=1e-4)


def test_one_document_per_row_through_the_mask_buffer_equals_is_causal():
    # document_ids all 0: the boolean mask is the causal_mask buffer itself, so this
    # runs SDPA with an explicit mask against SDPA's is_causal=True, through the
    # whole model.
    model = make_model()
    idx = random_tokens(2, 12)
    one_document = torch.zeros_like(idx)
    torch.testing.assert_close(
        model(idx), model(idx, document_ids=one_document), atol=FLOAT32_ATOL, rtol=0
    )


@pytest.mark.parametrize("causal", ["built", "the GPT's buffer"])
def test_document_causal_mask_lets_a_query_see_earlier_keys_of_its_own_document_only(
    causal,
):
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5]])
    buffer = make_model().causal_mask if causal == "the GPT's buffer" else None
    mask = document_causal_mask(document_ids, buffer)
    assert mask.shape == (2, 1, 8, 8) and mask.dtype == torch.bool
    for row in range(2):
        for query in range(8):
            for key in range(8):
                allowed = (
                    key <= query and document_ids[row, key] == document_ids[row, query]
                )
                assert mask[row, 0, query, key].item() == allowed, (row, query, key)


def test_rope_tables_from_given_frequencies_turn_each_pair_by_position_times_it():
    inv_freq = torch.tensor([1.0, 0.5, 0.25])  # any frequencies, not base's
    cos, sin = rope_tables(head_size=6, block_size=5, inv_freq=inv_freq)
    positions = torch.arange(5.0)[:, None]
    angles = torch.cat((positions * inv_freq, positions * inv_freq), dim=-1)
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())
    # the default frequencies, given explicitly, give the default tables
    default = ROPE_BASE ** (-torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    for given, made in zip(
        rope_tables(8, 5, inv_freq=default), rope_tables(8, 5), strict=True
    ):
        assert torch.equal(given, made)


def packed_pair(
    lengths: tuple[int, ...] = (5, 7, 4),
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Documents of ``lengths``, and one packed row with position and document ids."""
    documents = [random_tokens(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    idx = torch.cat(documents, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    return documents, idx, position_ids, document_ids


def test_each_packed_document_gets_the_logits_it_gets_alone():
    model = make_model()
    documents, idx, position_ids, document_ids = packed_pair()
    packed = model(idx, position_ids=position_ids, document_ids=document_ids)
    start = 0
    for document in documents:
        end = start + document.size(1)
        # Masked keys get weight exactly 0; only the kernel's summation order differs.
        torch.testing.assert_close(
            packed[:, start:end], model(document), atol=FLOAT32_ATOL, rtol=0
        )
        start = end


def test_without_the_document_mask_later_documents_see_earlier_ones():
    model = make_model()
    documents, idx, position_ids, _ = packed_pair()
    unmasked = model(idx, position_ids=position_ids)
    first = documents[0].size(1)
    # The first document has nothing before it; the second sees the first and changes.
    torch.testing.assert_close(
        unmasked[:, :first], model(documents[0]), atol=FLOAT32_ATOL, rtol=0
    )
    assert (
        unmasked[:, first : first + documents[1].size(1)] - model(documents[1])
    ).abs().max() > 1e-3


def test_position_ids_pick_each_tokens_rope_angles():
    model = make_model()
    idx = random_tokens(1, 6)
    shifted = torch.arange(3, 9)[None]  # the same tokens read as if at positions 3..8
    # With no document mask the absolute positions matter only through RoPE; shifting
    # every position by 3 leaves relative distances, so the logits agree to rounding,
    # while reversing the positions breaks causal order and changes them.
    torch.testing.assert_close(
        model(idx, position_ids=shifted), model(idx), atol=1e-5, rtol=0
    )
    reversed_positions = torch.arange(5, -1, -1)[None]
    # At initialisation attention moves the logits only slightly (weights of std
    # 0.02), so the change is about 4e-4: small, but 400 times the rounding bound
    # above would allow.
    assert (
        model(idx, position_ids=reversed_positions) - model(idx)
    ).abs().max() > 100 * FLOAT32_ATOL


def test_position_or_document_ids_of_another_shape_are_refused():
    idx = random_tokens(2, 6)
    with pytest.raises(
        ValueError, match=r"position_ids must have idx's shape \(2, 6\), got \(6,\)"
    ):
        make_model()(idx, position_ids=torch.arange(6))


@pytest.mark.parametrize("position", [CONFIG.block_size, -1])
def test_a_position_outside_the_rope_tables_is_refused_naming_it_and_block_size(
    position,
):
    # RoPE's tables have one row per position in [0, block_size); -1 would silently
    # read the last row, block_size would index past the end.
    position_ids = torch.arange(6)[None]
    position_ids[0, 4] = position
    with pytest.raises(
        ValueError,
        match=rf"position_ids holds {position} at position \(0, 4\).*"
        rf"\[0, block_size=16\)",
    ):
        make_model()(random_tokens(1, 6), position_ids=position_ids)


def test_document_ids_with_a_kv_cache_are_refused():
    # the cache keeps keys and values, not the document each cached position was in
    model, idx = make_model(), random_tokens(1, 4)
    with pytest.raises(ValueError, match=r"document_ids.*kv_cache"):
        model(
            idx,
            document_ids=torch.zeros_like(idx),
            kv_cache=(model._empty_cache(idx), 0),
        )


def gradients_after_one_backward(checkpointing: bool) -> list[torch.Tensor]:
    config = GPTConfig(
        vocab_size=65,
        block_size=16,
        n_layer=2,
        n_head=4,
        d_model=32,
        dropout=0.1,
        activation_checkpointing=checkpointing,
    )
    # training, with dropout: the recomputed masks must match
    model = make_model(config).train()
    idx = random_tokens(3, 16)
    torch.manual_seed(123)  # the same dropout draws for both runs
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    return [p.grad for p in model.parameters()]


def test_activation_checkpointing_gives_bitwise_equal_gradients():
    # Bitwise: the recomputed forward runs the same kernels on the same inputs, and
    # checkpoint restores the RNG state, so dropout draws the same masks again.
    plain, recomputed = (
        gradients_after_one_backward(False),
        gradients_after_one_backward(True),
    )
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed, strict=True))


def test_activation_checkpointing_saves_fewer_activations():
    idx = random_tokens(4, 16)
    config = GPTConfig(**{**vars(CONFIG), "activation_checkpointing": True})
    plain_model, checkpointed_model = make_model().train(), make_model(config).train()
    plain = saved_activation_bytes(
        plain_model, lambda: plain_model(idx).float().square().mean()
    )
    checkpointed = saved_activation_bytes(
        checkpointed_model, lambda: checkpointed_model(idx).float().square().mean()
    )
    # Each block keeps only its input (B, T, d_model) instead of a dozen tensors of
    # that size or more.
    assert checkpointed < plain / 2, (checkpointed, plain)


def test_derived_buffers_are_not_in_state_dict():
    model = make_model()
    buffer_names = {name for name, _ in model.named_buffers()}
    assert buffer_names == {"causal_mask", "rope_cos", "rope_sin"}
    keys = set(model.state_dict())
    assert keys.isdisjoint(buffer_names)
    assert keys == {name for name, _ in model.named_parameters(remove_duplicate=False)}


def test_state_dict_loads_into_a_fresh_model_which_rebuilds_its_buffers():
    source, target = make_model(seed=0), make_model(seed=1)
    target.load_state_dict(source.state_dict())  # strict: no missing or unexpected keys
    idx = random_tokens(2, 8)
    assert torch.equal(source(idx), target(idx))


def test_buffers_and_parameters_move_with_to_device():
    # the meta device stands in for an accelerator on any machine
    model = make_model().to("meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_forward_and_generate_run_on_cuda():
    model = make_model().to("cuda")
    idx = random_tokens(2, 5).to("cuda")
    assert (
        model.causal_mask.device.type == "cuda" and model.rope_cos.device.type == "cuda"
    )
    assert model(idx).device.type == "cuda"
    out = model.generate(
        idx, 4, generator=torch.Generator(device="cuda").manual_seed(0)
    )
    assert out.shape == (2, 9) and out.device.type == "cuda"


def test_to_dtype_converts_float_buffers_but_not_the_bool_mask():
    model = make_model().to(torch.float64)
    assert model.token_embedding.weight.dtype == torch.float64
    assert (
        model.rope_cos.dtype == torch.float64 and model.rope_sin.dtype == torch.float64
    )
    assert model.causal_mask.dtype == torch.bool


def test_weights_start_with_std_002_and_scaled_residual_projections():
    config = GPTConfig(vocab_size=64, block_size=8, n_layer=8, n_head=2, d_model=64)
    model = make_model(config)
    # A sample std over >= 4096 normal draws is within ~1.1% of the true std (one
    # standard error); 10% makes a false failure practically impossible while
    # still telling 0.02 from 0.02/4 = 0.005 apart.
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(
        INIT_STD, rel=0.1
    )
    scaled = INIT_STD / math.sqrt(2 * config.n_layer)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(
        scaled, rel=0.1
    )
    assert model.blocks[-1].mlp.proj.weight.std().item() == pytest.approx(
        scaled, rel=0.1
    )


def test_generate_appends_max_new_tokens():
    out = make_model().generate(
        random_tokens(2, 3),
        max_new_tokens=7,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.shape == (2, 10)
    assert out.dtype == torch.int64


def test_generate_is_deterministic_for_a_fixed_generator_seed():
    model, prompt = make_model(), random_tokens(2, 3)
    first = model.generate(prompt, 20, generator=torch.Generator().manual_seed(7))
    second = model.generate(prompt, 20, generator=torch.Generator().manual_seed(7))
    other = model.generate(prompt, 20, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first, second)
    # 40 draws from ~65 nearly equally likely tokens: two seeds agreeing everywhere is
    # (1/65)**40-unlikely, so inequality shows the generator is really used.
    assert not torch.equal(first, other)


def test_generate_builds_no_autograd_graph():
    model = make_model()
    assert all(p.requires_grad for p in model.parameters())
    out = model.generate(
        random_tokens(1, 3), 5, generator=torch.Generator().manual_seed(0)
    )
    assert out.grad_fn is None and not out.requires_grad
    assert torch.is_inference(out)


def test_generate_crops_a_long_prompt_to_block_size():
    model = make_model()
    prompt = random_tokens(1, CONFIG.block_size + 5)
    out = model.generate(prompt, 3, generator=torch.Generator().manual_seed(0))
    # The first new token depends only on the last block_size tokens: sampling it
    # by hand from the cropped prompt with the same seed gives the same token.
    logits = model(prompt[:, -CONFIG.block_size :])[:, -1, :]
    first = torch.multinomial(
        logits.softmax(-1), 1, generator=torch.Generator().manual_seed(0)
    )
    assert out.shape == (1, CONFIG.block_size + 8)
    assert torch.equal(out[:, : prompt.size(1)], prompt)
    assert out[0, prompt.size(1)].item() == first.item()


@pytest.mark.parametrize("use_cache", [False, True])
def test_generate_refuses_an_empty_prompt_naming_its_shape(use_cache):
    # the first token is sampled from the prompt's last position: there is none
    empty = torch.zeros(2, 0, dtype=torch.long)
    with pytest.raises(
        ValueError, match=r"GPT.generate: idx must hold at least one token.*\(2, 0\)"
    ):
        make_model().generate(empty, 3, use_cache=use_cache)


def test_generate_top_k_1_is_greedy():
    model, prompt = make_model(), random_tokens(2, 4)
    out = model.generate(prompt, 1, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out[:, -1], model(prompt)[:, -1, :].argmax(-1))


def test_too_long_input_raises_a_clear_error():
    with pytest.raises(
        ValueError, match=r"time <= block_size=16, got torch.int64 of shape \(1, 17\)"
    ):
        make_model()(random_tokens(1, CONFIG.block_size + 1))


def test_float_input_raises_a_clear_error():
    with pytest.raises(
        ValueError, match=r"idx must be int64 or int32 token ids.*got torch.float32"
    ):
        make_model()(torch.zeros(1, 4))


def test_config_rejects_an_odd_head_size_which_rope_cannot_pair():
    with pytest.raises(ValueError, match="head size d_model/n_head = 3 must be even"):
        GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=4, d_model=12)


def test_config_rejects_d_model_not_divisible_by_n_head():
    with pytest.raises(ValueError, match="d_model=30 must be divisible by n_head=4"):
        GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=4, d_model=30)


def test_token_id_equal_to_vocab_size_is_refused_naming_id_and_vocab_size():
    idx = random_tokens(2, 5)
    idx[1, 3] = CONFIG.vocab_size
    with pytest.raises(
        ValueError, match=r"token id 65 at position \(1, 3\).*\[0, 65\)"
    ):
        make_model()(idx)


def test_negative_token_id_is_refused_naming_it():
    idx = random_tokens(1, 4)
    idx[0, 0] = -1
    with pytest.raises(
        ValueError, match=r"GPT.forward: idx holds token id -1 .*\[0, 65\)"
    ):
        make_model()(idx)


def test_generate_refuses_an_out_of_range_prompt_id():
    prompt = torch.tensor([[0, CONFIG.vocab_size + 7]])
    with pytest.raises(ValueError, match=r"token id 72"):
        make_model().generate(prompt, 2)


def test_check_token_ids_accepts_the_full_range_and_an_empty_batch():
    check_token_ids(torch.tensor([[0, CONFIG.vocab_size - 1]]), CONFIG.vocab_size)
    check_token_ids(torch.zeros(0, 4, dtype=torch.long), CONFIG.vocab_size)
    with pytest.raises(ValueError, match=r"batch holds token id 65"):
        check_token_ids(
            torch.tensor([[CONFIG.vocab_size]]), CONFIG.vocab_size, where="batch"
        )


# Chapter 2 shows pieces of models.py as
# ```{.python filename="code/torchbook/models.py"}``` blocks (Quarto cannot include a
# line range); they must stay the module's own text.
MODELS_PATH = Path(__file__).resolve().parents[1] / "code" / "torchbook" / "models.py"
CHAPTER_2 = Path(__file__).resolve().parents[1] / "chapters" / "02-modules.qmd"
SHOWN_BLOCK = re.compile(
    r'^```\{\.python filename="code/torchbook/models\.py"\}\n(.*?)^```$',
    re.DOTALL | re.MULTILINE,
)


def test_chapter_2_shows_models_py_pieces_verbatim():
    blocks = SHOWN_BLOCK.findall(CHAPTER_2.read_text(encoding="utf-8"))
    source = MODELS_PATH.read_text(encoding="utf-8")
    pieces = {
        "class CausalSelfAttention",
        "class Block",
        "    def forward(\n        self,\n        idx",
        "class TinyMLP",
    }
    shown = {name for name in pieces if any(name in block for block in blocks)}
    assert shown == pieces, shown
    stale = [block.splitlines()[0] for block in blocks if block not in source]
    assert not stale, (
        f"chapter 2 shows code that is not in models.py as written: {stale}"
    )
