"""A GPT's training FLOPs per token, two ways, and how close a step comes to the peak.

It builds on ``torchbook.models`` (``GPTConfig``), ``torchbook.memory``
(``matmul_parameter_count``) and ``torchbook.memory_measure``
(``training_loss``/``training_step``, the book's training forward and step, so
that the FLOPs counted and the step timed are the ones whose memory chapter 7
measures).

``flops_per_token`` is the formula (6N plus attention's products, Kaplan et
al. 2020); ``count_training_flops`` counts the same step with PyTorch's
``FlopCounterMode``, which uses no formula of ours. ``throughput_metrics``
times real steps and reports model FLOPs utilisation (MFU) against the rate
``matmul_flops_per_second`` measures on the same device.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from torchbook.device import timed
from torchbook.memory import matmul_parameter_count
from torchbook.memory_measure import training_loss, training_step
from torchbook.models import GPTConfig


def flops_per_token(config: GPTConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6N for the matmul weights plus attention's products.

    Forward, each weight costs a multiply and an add per token (2N); backward
    costs twice that (4N: gradients for the input and for the weight).
    Attention multiplies q by T keys and the weights by T values: 2 x 2·T·C per
    token and layer forward, x3 with backward. Counted over the full (T, T)
    square, as FLOP counters count it; a causal kernel skips about half.
    """
    return (
        6 * matmul_parameter_count(config)
        + 12 * config.n_layer * seq_len * config.d_model
    )


def count_training_flops(
    model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, precision: str
) -> int:
    """FLOPs of one forward and backward pass, as ``FlopCounterMode`` counts them.

    On the CPU attention runs on SDPA's math path here: the counter has no
    formula for the CPU's fused kernel, which would leave attention out, and the
    math path does the same products as plain matmuls, which it counts. On CUDA
    the counter has formulas for the fused kernels (flash, memory-efficient), so
    attention runs as it would in training, without a (T, T) tensor per head.
    """
    math_path = (
        sdpa_kernel(SDPBackend.MATH)
        if idx.device.type == "cpu"
        else contextlib.nullcontext()
    )
    with FlopCounterMode(display=False) as counter, math_path:
        training_loss(model, idx, targets, precision).backward()
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
