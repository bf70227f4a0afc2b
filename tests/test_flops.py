"""torchbook.memory.flops: the FLOPs formula against FlopCounterMode, per attention."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import flop_registry

from torchbook.memory.flops import count_training_flops, flops_per_token
from torchbook.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, d_model=32)
BATCH, STEPS = 3, 48
aten = torch.ops.aten


def model_and_batch(
    config: GPTConfig = CONFIG,
) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, config.vocab_size, (BATCH, STEPS), generator=generator)
    return GPT(config).train(), idx, idx.roll(-1, dims=1)


@pytest.mark.parametrize("attention", ["math", "fused"])
def test_the_formula_equals_the_flop_counter(attention):
    model, idx, targets = model_and_batch()
    counted = count_training_flops(model, idx, targets, "fp32", attention)
    # Exact: both count the same products of the same shapes; no value is involved.
    assert counted == flops_per_token(CONFIG, STEPS, attention) * BATCH * STEPS


def test_fused_attention_costs_one_more_score_product_per_layer():
    # The fused kernels' backward recomputes q @ k^T: 2·T·C FLOPs per token and layer.
    extra = flops_per_token(CONFIG, STEPS, "fused") - flops_per_token(CONFIG, STEPS)
    assert extra == 2 * CONFIG.n_layer * STEPS * CONFIG.d_model


@pytest.mark.parametrize(
    ("forward", "backward"),
    [
        (
            aten._scaled_dot_product_flash_attention,
            aten._scaled_dot_product_flash_attention_backward,
        ),
        (
            aten._scaled_dot_product_efficient_attention,
            aten._scaled_dot_product_efficient_attention_backward,
        ),
        (
            aten._scaled_dot_product_cudnn_attention,
            aten._scaled_dot_product_cudnn_attention_backward,
        ),
    ],
    ids=["flash", "efficient", "cudnn"],
)
def test_the_fused_formula_is_what_the_counter_registers_for_cuda(forward, backward):
    """CUDA's fused kernels, counted from their shapes alone, as the counter would.

    FlopCounterMode's registered formulas take shapes, so the count a CUDA run
    gets for its attention is computed here without a GPU and set against the
    formula's fused attention term, per layer.
    """
    head_size = CONFIG.d_model // CONFIG.n_head
    qkv = (BATCH, CONFIG.n_head, STEPS, head_size)
    per_layer = flop_registry[forward](qkv, qkv, qkv) + flop_registry[backward](
        qkv, qkv, qkv, qkv
    )
    # The formula is 6N plus a term linear in the sequence length: the difference
    # between 2T and T is the attention term at T.
    attention_per_token = flops_per_token(CONFIG, 2 * STEPS, "fused") - flops_per_token(
        CONFIG, STEPS, "fused"
    )
    assert per_layer * CONFIG.n_layer == attention_per_token * BATCH * STEPS


def test_an_unknown_attention_is_refused_by_name():
    with pytest.raises(ValueError, match="attention='sparse'"):
        flops_per_token(CONFIG, STEPS, "sparse")
    model, idx, targets = model_and_batch()
    with pytest.raises(ValueError, match="attention='sparse'"):
        count_training_flops(model, idx, targets, "fp32", "sparse")


# each refusing kernel warns before SDPA raises; the error is what this test reads
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fused_attention_that_no_kernel_accepts_is_refused_by_name():
    # The CPU's fused kernel refuses attention dropout.
    config = GPTConfig(96, 64, 1, 4, 32, dropout=0.1)
    model, idx, targets = model_and_batch(config)
    with pytest.raises(ValueError, match="no fused SDPA kernel"):
        count_training_flops(model, idx, targets, "fp32", "fused")
