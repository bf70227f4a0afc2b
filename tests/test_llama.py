"""code/torchbook/llama.py: each part of the Llama against an independent computation.

The whole model against transformers' ``LlamaForCausalLM`` is in
``test_hf_checkpoint.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from torchbook.decoder import INIT_STD
from torchbook.llama import (
    Llama,
    Llama3RopeScaling,
    LlamaBlock,
    LlamaConfig,
    RMSNorm,
    Sampling,
    filtered_logits,
    next_token,
    rope_frequencies,
)

CONFIG = LlamaConfig(
    vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, mlp_size=48
)
# float32: the compared computations differ only in summation order.
ATOL = RTOL = 1e-5


def tiny_llama(config: LlamaConfig = CONFIG, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(config).eval()
    with torch.no_grad():  # weights large enough that argmaxes are clear
        for parameter in model.parameters():
            parameter.mul_(10)
    return model


def ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(CONFIG.vocab_size, (batch, length), generator=generator)


def test_rmsnorm_is_torch_rms_norm():
    norm = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 16)
    expected = F.rms_norm(x, (16,), norm.weight, eps=1e-6)
    torch.testing.assert_close(norm(x), expected, atol=ATOL, rtol=RTOL)


def test_llama3_frequencies_are_transformers_for_llama_3_1_settings():
    config = LlamaConfig(
        vocab_size=8,
        n_layer=1,
        n_head=32,
        n_kv_head=8,
        d_model=2048,
        mlp_size=8,
        max_positions=131_072,
        rope_theta=500_000.0,
        rope_scaling=Llama3RopeScaling(),  # Llama 3.1's factor 8 over 8,192 positions
    )
    reference = transformers.LlamaConfig(
        hidden_size=2048,
        num_attention_heads=32,
        max_position_embeddings=131_072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](reference, torch.device("cpu"))
    ours = rope_frequencies(config, torch.device("cpu"))
    torch.testing.assert_close(ours, expected, atol=0, rtol=1e-6)
    plain = rope_frequencies(
        LlamaConfig(8, 1, 32, 8, 2048, 8, rope_theta=500_000.0), torch.device("cpu")
    )
    assert torch.equal(ours[0], plain[0])  # the fastest rotation is kept
    torch.testing.assert_close(ours[-1], plain[-1] / 8)  # the slowest is slowed by 8


def test_grouped_query_attention_is_full_attention_with_each_kv_head_repeated():
    grouped = tiny_llama()
    full = Llama(LlamaConfig(**{**vars(CONFIG), "n_kv_head": CONFIG.n_head})).eval()
    state = grouped.state_dict()
    group = CONFIG.n_head // CONFIG.n_kv_head
    for key, tensor in state.items():
        if key.endswith(("attn.key.weight", "attn.value.weight")):
            heads = tensor.view(CONFIG.n_kv_head, CONFIG.head_size, CONFIG.d_model)
            tensor = heads.repeat_interleave(group, dim=0).reshape(-1, CONFIG.d_model)
        full.state_dict()[key].copy_(tensor)
    x = ids(2, 10)
    with torch.no_grad():
        torch.testing.assert_close(grouped(x), full(x), atol=ATOL, rtol=RTOL)


def test_generation_with_the_kv_cache_equals_rerunning_the_whole_prefix():
    model = tiny_llama()
    prompt = ids(2, 5)
    expected = prompt
    with torch.no_grad():
        for _ in range(12):
            token = model(expected)[:, -1].argmax(dim=-1, keepdim=True)
            expected = torch.cat((expected, token), dim=1)
    assert torch.equal(model.generate(prompt, max_new_tokens=12), expected)


def test_a_prompt_continued_through_the_cache_gives_the_logits_of_the_whole():
    # the cache holds positions 0..4; the next 6 tokens run at once (a query
    # at position p sees keys 0..p), as a prompt fed in two pieces
    model = tiny_llama()
    tokens = ids(2, 11)
    cache = model.new_cache(2, 11, torch.device("cpu"))
    with torch.no_grad():
        first = model(tokens[:, :5], kv_cache=(cache, 0))
        rest = model(tokens[:, 5:], kv_cache=(cache, 5))
        whole = model(tokens)
    torch.testing.assert_close(torch.cat((first, rest), 1), whole, atol=ATOL, rtol=RTOL)


def test_generation_hands_sdpa_no_mask_where_is_causal_or_no_mask_says_it(
    monkeypatch,
):
    # A mask beside enable_gqa rules out fused CUDA kernels; transformers passes
    # none when is_causal (the prompt) or nothing (one new token, which sees
    # every cached position) says the same.
    masks = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        masks.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    tiny_llama().generate(ids(2, 5), max_new_tokens=4)
    assert masks and all(mask is None for mask, _ in masks)
    per_step = CONFIG.n_layer
    assert all(causal for _, causal in masks[:per_step])  # the prompt
    assert not any(causal for _, causal in masks[per_step:])  # one token each


def test_generating_from_an_empty_prompt_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="Llama.generate: idx"):
        tiny_llama().generate(torch.zeros(1, 0, dtype=torch.long), 4)


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"head_size": 0}, "head_size"), ({"d_model": 2, "n_head": 4}, "head_size")],
)
def test_a_head_size_below_one_is_refused(fields, named):
    shape = {"vocab_size": 8, "n_layer": 1, "n_head": 4, "n_kv_head": 2}
    with pytest.raises(ValueError, match=named):
        LlamaConfig(**{**shape, "d_model": 32, "mlp_size": 8, **fields})


def test_the_blocks_are_llama_blocks():
    # one name per idea: models.Block is the GPT's
    assert all(isinstance(block, LlamaBlock) for block in tiny_llama().blocks)


def test_the_cache_stores_only_the_key_value_heads():
    # on meta, as a memory estimate of a big model builds it: shapes, no bytes
    cache = tiny_llama().new_cache(batch=3, length=20, device=torch.device("meta"))
    assert cache.shape == (2, CONFIG.n_layer, 3, CONFIG.n_kv_head, 20, CONFIG.head_size)


def test_packed_documents_give_the_logits_each_has_alone():
    model = tiny_llama()
    first, second = ids(1, 7, seed=2), ids(1, 5, seed=3)
    row = torch.cat((first, second), dim=1)
    position_ids = torch.cat((torch.arange(7), torch.arange(5)))[None]
    document_ids = torch.tensor([[0] * 7 + [1] * 5])
    with torch.no_grad():
        packed = model(row, position_ids=position_ids, document_ids=document_ids)
        alone = torch.cat((model(first), model(second)), dim=1)
    torch.testing.assert_close(packed, alone, atol=ATOL, rtol=RTOL)


def test_a_position_beyond_max_positions_is_refused():
    model = tiny_llama(LlamaConfig(**{**vars(CONFIG), "max_positions": 8}))
    with pytest.raises(ValueError, match="max_positions=8"):
        model(ids(1, 9))


def test_a_head_count_that_does_not_group_is_refused():
    with pytest.raises(ValueError, match="multiple of n_kv_head=3"):
        LlamaConfig(
            vocab_size=8, n_layer=1, n_head=4, n_kv_head=3, d_model=32, mlp_size=8
        )


# ------------------------------------------------------------ sampling

# Probabilities 0.5, 0.3, 0.15, 0.05 for tokens 0..3.
PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
DRAWS = 2000


def drawn(sampling: Sampling, seed: int = 0) -> torch.Tensor:
    """The tokens of ``DRAWS`` independent draws from PROBS."""
    generator = torch.Generator().manual_seed(seed)
    logits = PROBS.log().expand(DRAWS, -1)
    return next_token(logits, sampling, generator).flatten()


def test_top_k_and_top_p_keep_only_their_tokens():
    assert set(drawn(Sampling(top_k=2)).tolist()) <= {0, 1}
    # 0.5 + 0.3 reaches 0.8: token 2 is not needed
    assert set(drawn(Sampling(top_p=0.8)).tolist()) <= {0, 1}
    # 0.5 alone does not reach 0.81: token 1 is kept too, token 2 not
    assert set(drawn(Sampling(top_p=0.81)).tolist()) <= {0, 1, 2}
    assert set(drawn(Sampling(top_p=0.5)).tolist()) == {0}


def test_without_a_filter_every_token_is_drawn():
    assert set(drawn(Sampling()).tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=0.7),
        Sampling(top_k=5),
        Sampling(top_p=0.9),
        Sampling(temperature=0.7, top_k=20, top_p=0.8),
    ],
)
def test_the_filters_keep_what_transformers_warpers_keep(sampling):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature)])
    if sampling.top_k is not None:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p is not None:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    # 4,096 rows of 2,048 logits: in a few of them (two at this seed) a sum
    # lands within float32 rounding of top_p, and only summing in transformers'
    # order keeps the same tokens there
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4096, 2048, generator=generator) * 2
    ours = filtered_logits(logits, sampling).softmax(-1)
    theirs = warpers(None, logits.clone()).softmax(-1)
    assert torch.equal(ours > 0, theirs > 0)  # the same tokens kept
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("top_p", [0.5, 0.8, 0.95])
def test_top_p_where_a_sum_lands_on_p_keeps_what_transformers_keeps(top_p):
    # 0.5 and 0.5 + 0.3 and 0.5 + 0.3 + 0.15: p itself, up to float32 rounding,
    # which must round as transformers' does for the same tokens to stay
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = PROBS.log()
    ours = filtered_logits(logits, Sampling(top_p=top_p)).isfinite()
    assert torch.equal(ours, TopPLogitsWarper(top_p)(None, logits.clone()).isfinite())


def test_the_same_seed_draws_the_same_tokens():
    model = tiny_llama()
    sampling = Sampling(temperature=0.8, top_k=20, top_p=0.9)

    def sample(seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return model.generate(ids(2, 4), 16, sampling, generator)

    assert torch.equal(sample(7), sample(7))


def test_top_k_of_one_is_greedy():
    model = tiny_llama()
    generator = torch.Generator().manual_seed(0)
    sampled = model.generate(ids(2, 4), 10, Sampling(top_k=1), generator)
    assert torch.equal(sampled, model.generate(ids(2, 4), 10))


@pytest.mark.parametrize(
    "settings",
    [{"temperature": 0.0}, {"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}],
)
def test_a_sampling_setting_out_of_range_is_refused(settings):
    with pytest.raises(ValueError, match=f"Sampling.{next(iter(settings))}"):
        Sampling(**settings)


def test_packed_rows_cannot_use_the_kv_cache_which_keeps_no_document_ids():
    # Before this was refused, the cache's causal mask replaced the document mask
    # and a query saw the other documents of its row.
    model = tiny_llama()
    cache = model.new_cache(1, 6, torch.device("cpu"))
    with pytest.raises(ValueError, match="document_ids cannot be combined"):
        model(
            ids(1, 6),
            document_ids=torch.zeros(1, 6, dtype=torch.long),
            kv_cache=(cache, 0),
        )


@pytest.mark.parametrize("position", [-1, 6])
def test_a_position_id_outside_the_row_is_refused_naming_the_argument(position):
    position_ids = torch.arange(6)[None].clone()
    position_ids[0, 3] = position
    with pytest.raises(ValueError, match=r"position_ids run from .* outside \[0, 6\)"):
        tiny_llama()(ids(1, 6), position_ids=position_ids)


def test_weights_start_at_the_gpts_initialisation():
    # one home: decoder.init_weights, N(0, INIT_STD) for every linear and embedding
    torch.manual_seed(0)
    model = Llama(
        LlamaConfig(
            vocab_size=512, n_layer=1, n_head=4, n_kv_head=2, d_model=128, mlp_size=256
        )
    )
    for name in ("token_embedding.weight", "blocks.0.mlp.gate.weight"):
        weight = model.get_parameter(name)
        # about 32,000 and 65,000 draws: the sample std is within 2% of 0.02
        assert weight.std().item() == pytest.approx(INIT_STD, rel=0.02), name
