"""A GPT's training FLOPs per token, two ways, and how close a step comes to the peak.

It builds on ``torchbook.models`` (``GPTConfig``), ``torchbook.memory.gpt``
(``matmul_parameter_count``) and ``torchbook.memory.measure``
(``training_loss``/``training_step``, the book's training forward and step, so
that the FLOPs counted and the step timed are the ones whose memory chapter 7
measures).

``flops_per_token`` is the formula: 6N for the weights (Kaplan et al. 2020)
plus attention's products, 12·n_layer·T·C (PaLM, Chowdhery et al. 2022,
appendix B), or 14·n_layer·T·C for the fused kernels, whose backward recomputes
the scores. ``count_training_flops`` counts the same step with PyTorch's
``FlopCounterMode``, which uses no formula of ours. ``throughput_metrics``
times real steps and reports model FLOPs utilisation (MFU) against the rate
``matmul_flops_per_second`` measures on the same device.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from torchbook.device import timed
from torchbook.memory.gpt import matmul_parameter_count
from torchbook.memory.measure import training_loss, training_step
from torchbook.models import GPTConfig

aten = torch.ops.aten
# Attention's (T, T) products in a training step: q @ k^T and weights @ v forward,
# two gradients of each backward; the fused kernels keep no scores, so their
# backward first recomputes q @ k^T.
ATTENTION_PRODUCTS = {"math": 2 + 4, "fused": 2 + 5}
SDPA_BACKENDS = {
    "math": [SDPBackend.MATH],
    "fused": [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
    ],
}
# FlopCounterMode has formulas for CUDA's fused kernels but none for the CPU's
# flash kernel, which does the same products: count it with CUDA's flash formulas
# (unwrapped: the counter wraps a custom formula in its shape adapter itself).
CPU_FLASH_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: inspect.unwrap(
        flop_registry[aten._scaled_dot_product_flash_attention]
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: inspect.unwrap(
        flop_registry[aten._scaled_dot_product_flash_attention_backward]
    ),
}


def _check_attention(attention: str) -> None:
    if attention not in ATTENTION_PRODUCTS:
        raise ValueError(
            f"attention={attention!r}: expected one of {sorted(ATTENTION_PRODUCTS)}"
        )


def flops_per_token(config: GPTConfig, seq_len: int, attention: str = "math") -> int:
    """Training FLOPs per token: 6N for the matmul weights plus attention's products.

    Forward, each weight costs a multiply and an add per token (2N); backward
    costs twice that (4N: gradients for the input and for the weight). Each
    (T, T) product of attention costs 2·T·C per token and layer, over the full
    square, as FLOP counters count it (a causal kernel skips about half).
    ``attention="math"`` counts the six products the model needs, 12·n_layer·T·C,
    PaLM's model FLOPs; ``"fused"`` counts what the flash, memory-efficient and
    cuDNN kernels run, seven, since their backward recomputes the scores.
    """
    _check_attention(attention)
    attention_flops = 2 * ATTENTION_PRODUCTS[attention] * seq_len * config.d_model
    return 6 * matmul_parameter_count(config) + config.n_layer * attention_flops


def count_training_flops(
    model: nn.Module,
    idx: torch.Tensor,
    targets: torch.Tensor,
    precision: str,
    attention: str = "math",
) -> int:
    """FLOPs of one forward and backward pass, as ``FlopCounterMode`` counts them.

    ``attention`` picks SDPA's kernels, on any device: ``"math"`` runs attention
    as plain matmuls, ``"fused"`` on a fused kernel (the CPU's flash kernel,
    counted with the formulas PyTorch registers for CUDA's flash kernel).
    """
    _check_attention(attention)
    counter = FlopCounterMode(display=False, custom_mapping=CPU_FLASH_FORMULAS)
    try:
        with counter, sdpa_kernel(SDPA_BACKENDS[attention]):
            training_loss(model, idx, targets, precision).backward()
    except RuntimeError as error:
        if attention == "fused" and "No available kernel" in str(error):
            raise ValueError(
                f"count_training_flops: no fused SDPA kernel accepts this model's "
                f"attention on {idx.device} (attention dropout on the CPU, or a head "
                f"size or dtype the kernels do not take); use attention='math'"
            ) from error
        raise
    finally:
        model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def matmul_flops_per_second(
    size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
) -> float:
    """Best FLOP rate of a (size x size) matmul: this machine's practical peak."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    a @ b  # warm-up: the first call pays for allocation and kernel selection
    best = min(timed(lambda: a @ b, device)[1] for _ in range(repeats))
    return 2 * size**3 / best


def throughput_metrics(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    idx: torch.Tensor,
    targets: torch.Tensor,
    precision: str,
    steps: int,
    peak_flops_per_second: float,
) -> dict[str, float]:
    """Tokens per second of ``training_step``, FLOPs per token, and MFU against a peak.

    The speed is the best of ``steps`` steps. MFU, model FLOPs utilisation
    (Chowdhery et al. 2022, PaLM), is the FLOP rate the model's formula implies at
    the measured speed, divided by a peak: here the rate ``matmul_flops_per_second``
    measures on the same device, one this machine reaches, rather than a datasheet's.
    """

    def step() -> None:
        training_step(model, optimizer, idx, targets, precision)

    step()  # warm-up: AdamW's states, the allocator's blocks
    best = min(timed(step, idx.device)[1] for _ in range(steps))
    tokens_per_second = idx.numel() / best
    per_token = flops_per_token(model.config, idx.size(1))
    return {
        "step_s": best,
        "tokens_per_second": tokens_per_second,
        "flops_per_token": float(per_token),
        "model_flops_per_second": per_token * tokens_per_second,
        "matmul_flops_per_second": peak_flops_per_second,
        "mfu": per_token * tokens_per_second / peak_flops_per_second,
    }
