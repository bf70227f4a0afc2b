"""Where a GPT's training memory goes: predicted from its config, and measured.

It builds on ``torchbook.models`` (``GPTConfig`` and the ``GPT`` whose saved
tensors the formula counts, one by one) and ``torchbook.profiles`` (the
precisions, and the gpu sizes whose fit it predicts).

Training memory has four kinds (Rajbhandari et al. 2020, "ZeRO"):

- parameters: float32 weights, 4 bytes each (autocast keeps them float32);
- gradients: one float32 number per parameter;
- optimizer states: AdamW's two float32 moments (8 bytes per parameter) and a
  step counter per parameter tensor;
- saved activations: what the forward pass keeps for the backward pass. They
  grow with batch x sequence length, and for long contexts they dominate.

ZeRO stage 1 shards the optimizer states over the data-parallel ranks, stage 2
also the gradients, stage 3 (and FSDP) also the parameters. Activations are
never sharded by data parallelism: each rank keeps those of its own batch.

The activation formula is derived for this GPT tensor by tensor (see
``activation_terms``), in the way Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models") derive 34·s·b·h + 5·a·s²·b bytes per
layer for GPT-3. Their (T, T) term, the softmax and dropout of the attention
scores, appears here only when attention falls back to PyTorch's "math" path:
the fused kernels (flash, memory-efficient, and the CPU's flash kernel) keep
just one logsumexp per query and head. On the CPU that fallback happens when
attention dropout is on; CUDA's fused kernels handle dropout themselves.

The measurements use no formula: the bytes of the tensors that exist, a
``saved_tensors_hooks`` pack hook that sees every tensor autograd saves
(each storage counted once), and the allocator's own running total for the peak.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from torchbook.device import AUTOCAST_DTYPES, synchronize
from torchbook.models import MLP_EXPANSION, GPTConfig
from torchbook.profiles import gpu_sizes, make_profile

GPU_BYTES = 80 * 10**9  # the GPUs readers rent: A100 / H100 with 80 GB
FIT_SHARE = 0.5  # a run "fits" when its predicted peak is at most half of that: the rest is for the CUDA
# context, cuBLAS workspaces, the caching allocator's fragmentation and torch.compile's buffers
CHAR_VOCAB = 256  # character-level models: at most 256 symbols (Tiny Shakespeare has 65), an upper bound
FP32 = 4  # bytes of a float32: weights, gradients, Adam moments, LayerNorm inputs and statistics
INDEX = (
    8  # bytes of an int64 token id (the input ids, and the targets cross-entropy keeps)
)
SHARDINGS = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp")
# Which of parameters / gradients / optimizer states each scheme divides by the number of ranks.
SHARDED = {
    "none": (),
    "ddp": (),
    "zero1": ("optimizer_states",),
    "zero2": ("gradients", "optimizer_states"),
    "zero3": ("parameters", "gradients", "optimizer_states"),
    "fsdp": ("parameters", "gradients", "optimizer_states"),
}


@dataclass(frozen=True)
class TrainingShape:
    """What a training step looks like, besides the model: batch, precision, recomputation, sharding."""

    batch_size: int  # rows per rank per micro-batch
    seq_len: int
    precision: str = "fp32"  # a key of AUTOCAST_DTYPES
    checkpointing: bool = False  # each block under torch.utils.checkpoint
    sharding: str = "none"  # one of SHARDINGS
    world_size: int = 1  # data-parallel ranks
    device_type: str = "cpu"  # "cpu" or "cuda": decides the dropout masks' dtype and the attention kernel

    def __post_init__(self) -> None:
        if self.precision not in AUTOCAST_DTYPES:
            raise ValueError(
                f"TrainingShape.precision={self.precision!r}; expected one of {list(AUTOCAST_DTYPES)}"
            )
        if self.sharding not in SHARDINGS:
            raise ValueError(
                f"TrainingShape.sharding={self.sharding!r}; expected one of {SHARDINGS}"
            )
        if min(self.batch_size, self.seq_len, self.world_size) < 1:
            raise ValueError(
                f"TrainingShape: batch_size, seq_len and world_size must be >= 1, got {self}"
            )


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank of each kind of training memory."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int

    @property
    def total(self) -> int:
        return (
            self.parameters + self.gradients + self.optimizer_states + self.activations
        )


def parameter_count(config: GPTConfig) -> int:
    """Parameters of ``GPT(config)``: the tied embedding, n_layer blocks, the final LayerNorm."""
    width, hidden = config.d_model, MLP_EXPANSION * config.d_model
    # MLP
    block = (
        2 * 2 * width  # two LayerNorms, weight and bias
        + (width * 3 * width + 3 * width)
        + (width * width + width)  # qkv and attention projection
        + (width * hidden + hidden)
        + (hidden * width + width)
    )
    return config.vocab_size * width + config.n_layer * block + 2 * width


def matmul_parameter_count(config: GPTConfig) -> int:
    """Weights that take part in a matrix multiplication: every block's four matrices and the tied head.

    This is the N of "6N FLOPs per token": biases and LayerNorms cost a few
    operations per token, and the embedding lookup none.
    """
    return (
        config.n_layer * (3 + 1 + 2 * MLP_EXPANSION) * config.d_model**2
        + config.vocab_size * config.d_model
    )


def parameter_tensor_count(config: GPTConfig) -> int:
    """Parameter tensors of ``GPT(config)``: AdamW keeps one step counter for each."""
    # embedding; 6 weights and 6 biases per block; final LayerNorm
    return 1 + 12 * config.n_layer + 2


def activation_terms(config: GPTConfig, shape: TrainingShape) -> dict[str, int]:
    """Bytes autograd saves during one forward pass, by where they come from.

    Per token, with C = d_model, H = n_head, V = vocab_size and a = the bytes of
    the compute dtype (4 in float32, 2 under bf16/fp16 autocast), each block saves:

    - 2 x 4C: the float32 inputs of its two LayerNorms (the residual stream), and
      4 x 4 bytes of their means and inverse standard deviations;
    - a·10C: the normalised inputs of the qkv and fc Linears (C each), the fc
      output GELU needs (4C) and the GELU output the second Linear needs (4C);
    - fused attention, a·6C + 4H: the qkv output (3C; v is a view of it),
      RoPE-rotated q and k (2C), attention's output (C; the projection reads it
      as a view) and one float32 logsumexp per query and head;
    - or the CPU's math path (attention dropout on): float32 q, k, v (3 x 4C),
      three float32 (T, T) tensors per head (softmax output, dropout mask,
      dropped weights: 3 x 4HT) and the output (aC); 2 x 4C more for a single
      float32 row, measured: there its reshapes are views and it keeps both;
    - with dropout, two masks of C (the input's dtype on the CPU, 1-byte bools on CUDA).

    Outside the blocks: the token ids, the embedding's dropout mask, the final
    LayerNorm (4C + 8 + aC) and cross-entropy's float32 log-probabilities (4V)
    and int64 targets. Under autocast every weight of a matmul is also saved as
    its low-precision copy (2 bytes per matmul weight, once per step).

    With checkpointing a block keeps only its float32 input (4C per token); its
    other terms exist again, for one block at a time, during the backward pass.
    """
    tokens = shape.batch_size * shape.seq_len
    width, heads, steps = config.d_model, config.n_head, shape.seq_len
    low = AUTOCAST_DTYPES[shape.precision].itemsize
    dropout = config.dropout > 0
    # bytes per element of a dropout mask
    mask = (1 if shape.device_type == "cuda" else low) if dropout else 0
    if dropout and shape.device_type == "cpu":  # SDPA's math path
        attention = 3 * FP32 * width + 3 * FP32 * heads * steps + low * width
        # one float32 row: its reshapes are views, two more C kept
        if shape.batch_size == 1 and low == FP32:
            attention += 2 * FP32 * width
    else:  # a fused kernel
        attention = low * 6 * width + FP32 * heads
    block = (
        2 * FP32 * width
        + 4 * FP32  # LayerNorm inputs and statistics
        + low
        # qkv and fc inputs, fc and GELU outputs
        * (2 * width + 2 * MLP_EXPANSION * width)
        + attention
        + 2 * mask * width
    )
    if shape.checkpointing:
        block = FP32 * width
    # Under checkpointing only the head's copy is saved; the blocks' are made again when recomputed.
    copied = (
        config.vocab_size * config.d_model
        if shape.checkpointing
        else matmul_parameter_count(config)
    )
    weight_copies = 2 * copied if low < FP32 else 0
    embedding_mask = (
        (1 if shape.device_type == "cuda" else FP32) * width if dropout else 0
    )
    return {
        "blocks": tokens * config.n_layer * block,
        "embedding and ids": tokens * (INDEX + embedding_mask),
        "final norm and head": tokens * (FP32 * width + 2 * FP32 + low * width),
        "cross-entropy": tokens * (FP32 * config.vocab_size + INDEX) + FP32,
        "autocast weight copies": weight_copies,
    }


def predict_memory(config: GPTConfig, shape: TrainingShape) -> MemoryBreakdown:
    """Bytes per rank of parameters, gradients, optimizer states and saved activations."""
    count = parameter_count(config)
    sizes = {
        "parameters": FP32 * count,
        "gradients": FP32 * count,
        "optimizer_states": 2 * FP32 * count + FP32 * parameter_tensor_count(config),
    }
    for kind in SHARDED[shape.sharding]:
        sizes[kind] = math.ceil(sizes[kind] / shape.world_size)
    return MemoryBreakdown(
        activations=sum(activation_terms(config, shape).values()), **sizes
    )


def predict_peak(config: GPTConfig, shape: TrainingShape) -> int:
    """Bytes allocated at the busiest moment of a training step, once AdamW has its states.

    Parameters and optimizer states are always there, and so are the logits,
    which the loop holds until the step ends (a·V per token, as in
    ``training_step`` and the book's ``Trainer``). The candidates are:

    - the start of the backward pass: every saved activation, plus cross-entropy's
      two float32 gradients of V per token;
    - each block's backward, last block first: the activations not yet freed,
      the gradients made so far and this block's, two residual-stream
      gradients, with checkpointing the block's recomputed activations, and on
      SDPA's math path the gradient of one (T, T) tensor per head (less the
      block's MLP tensors, freed by the time attention's backward runs);
    - the optimizer step: every gradient.

    Gradients are None until the backward pass (``zero_grad(set_to_none=True)``).
    """
    memory = predict_memory(config, shape)
    terms = activation_terms(config, shape)
    tokens = shape.batch_size * shape.seq_len
    width, low = config.d_model, AUTOCAST_DTYPES[shape.precision].itemsize
    # < 1 when gradients are sharded
    grad_share = memory.gradients / (FP32 * parameter_count(config))
    block_params = (
        parameter_count(config) - config.vocab_size * width - 2 * width
    ) // config.n_layer
    block_grads = FP32 * block_params * grad_share
    always = (
        memory.parameters + memory.optimizer_states + tokens * config.vocab_size * low
    )
    recompute = 0  # what a block's backward holds beyond the saved tensors
    # one block's saved tensors, made again, and its weights' low-precision copies
    if shape.checkpointing:
        unsaved = TrainingShape(
            shape.batch_size,
            shape.seq_len,
            shape.precision,
            device_type=shape.device_type,
        )
        recompute = activation_terms(config, unsaved)["blocks"] // config.n_layer
        if low < FP32:
            recompute += (
                2
                * (matmul_parameter_count(config) - config.vocab_size * width)
                // config.n_layer
            )
    if config.dropout > 0 and shape.device_type == "cpu":
        # The math path's backward peaks in attention, holding the gradient of one (T, T) tensor per head;
        # the MLP's saved tensors of that block are freed by then.
        mask = low * width  # the MLP's dropout mask
        mlp_saved = (
            FP32 * width + 2 * FP32 + low * (width + 2 * MLP_EXPANSION * width) + mask
        )
        recompute += max(0, (FP32 * config.n_head * shape.seq_len - mlp_saved) * tokens)
    moments = [always + memory.activations + 2 * FP32 * tokens * config.vocab_size]
    remaining = (
        memory.activations - terms["cross-entropy"] - terms["final norm and head"]
    )
    # tied head and final LayerNorm
    grads = FP32 * (config.vocab_size * width + 2 * width) * grad_share
    for _ in range(config.n_layer):
        moments.append(
            always
            + remaining
            + grads
            + block_grads
            + recompute
            + 2 * FP32 * width * tokens
        )
        remaining -= terms["blocks"] // config.n_layer
        grads += block_grads
    moments.append(always + memory.gradients)
    return int(max(moments))


# Measurements. None of them uses the formulas above.


def training_loss(
    model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, precision: str
) -> torch.Tensor:
    """The book's training forward: logits under autocast, cross-entropy in float32 (as ``Trainer`` does)."""
    with torch.autocast(
        idx.device.type, dtype=AUTOCAST_DTYPES[precision], enabled=precision != "fp32"
    ):
        logits = model(idx)
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


def training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    idx: torch.Tensor,
    targets: torch.Tensor,
    precision: str,
) -> None:
    """One step in the order of the book's ``Trainer``: forward, loss, backward, step, zero_grad.

    The logits stay referenced until the step ends, as they do in the loop.
    """
    with torch.autocast(
        idx.device.type, dtype=AUTOCAST_DTYPES[precision], enabled=precision != "fp32"
    ):
        logits = model(idx)
    F.cross_entropy(logits.float().flatten(0, -2), targets.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def storage_bytes(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tied weight or a view counts once)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
    }
    return sum(storages.values())


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Exact bytes of the parameters, their gradients and the optimizer's state tensors."""
    parameters = list(model.parameters())
    states = [
        v
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]
    return {
        "parameters": storage_bytes(parameters),
        "gradients": storage_bytes(p.grad for p in parameters if p.grad is not None),
        "optimizer_states": storage_bytes(states),
    }


def saved_activation_bytes(
    model: nn.Module, forward: Callable[[], torch.Tensor]
) -> int:
    """Bytes of the tensors autograd saves while ``forward()`` runs, each storage once.

    Parameters and buffers are saved too (a Linear keeps its weight), but they
    exist anyway; they are left out so the count is the memory the step adds.
    """
    existing = {
        t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]
    }
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in existing:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = forward()
    del loss  # frees the graph
    return sum(saved.values())


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the process's stderr: Kineto, the profiler's engine, writes status lines there."""
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def peak_bytes(step: Callable[[], None], device: torch.device) -> int:
    """Most bytes ``step()`` has allocated at once, above what was allocated before it.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: the profiler's memory
    records, which carry the allocator's running total of the bytes allocated
    since profiling started. Add the tensors that already existed (parameters,
    optimizer states: ``state_bytes``) for the step's whole footprint.
    """
    device = torch.device(device)
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with (
        _quiet_stderr(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler,
    ):
        step()
    with tempfile.TemporaryDirectory() as folder:
        trace = os.path.join(folder, "trace.json")
        with _quiet_stderr():
            profiler.export_chrome_trace(trace)
        with open(trace) as file:
            events = json.load(file)["traceEvents"]
    totals = [
        event["args"]["Total Allocated"]
        for event in events
        if event.get("name") == "[memory]"
    ]
    return max(totals, default=0)


# Will the book's GPU runs fit? Predicted from the gpu sizes, so no GPU is needed to ask.


def mlp_peak(widths: tuple[int, ...], batch_size: int) -> int:
    """Upper bound on an MLP's training peak: 16 bytes per parameter, and every layer's input and output kept."""
    parameters = sum(a * b + b for a, b in pairwise(widths))
    return 4 * FP32 * parameters + 2 * FP32 * batch_size * sum(widths)


def gpu_run_peaks() -> dict[str, int]:
    """Predicted peak bytes of each run the book makes at gpu-profile sizes (bf16 autocast on CUDA)."""
    cpu = make_profile("cpu")
    lm, device, demo, memory, lab = (
        gpu_sizes(sizes)
        for sizes in (cpu.lm, cpu.devices, cpu.checkpoint, cpu.memory, cpu.lab)
    )
    runs = {
        "ch. 3 language model (and the compile results)": (
            GPTConfig(
                CHAR_VOCAB, lm.block_size, lm.n_layer, lm.n_head, lm.d_model, lm.dropout
            ),
            lm.batch_size,
            lm.block_size,
        ),
        "ch. 5 loading demo (as if trained on its 2 x 16 input)": (
            GPTConfig(
                demo.demo_vocab_size,
                demo.demo_block_size,
                demo.demo_n_layer,
                demo.demo_n_head,
                demo.demo_d_model,
            ),
            2,
            16,
        ),
        "ch. 6 torch.compile model": (
            GPTConfig(
                device.vocab_size,
                device.compile_block_size,
                device.compile_n_layer,
                device.n_head,
                device.compile_d_model,
            ),
            device.compile_batch_size,
            device.compile_block_size,
        ),
        "ch. 7 largest configuration": (
            GPTConfig(
                memory.vocab_size,
                max(memory.seq_lens),
                memory.n_layer,
                memory.n_head,
                memory.d_model,
            ),
            memory.batch_size,
            max(memory.seq_lens),
        ),
    }
    peaks = {
        name: predict_peak(
            config, TrainingShape(batch, steps, "bf16", device_type="cuda")
        )
        for name, (config, batch, steps) in runs.items()
    }
    peaks["ch. 8 lab MLP"] = mlp_peak((28 * 28, *lab.hidden, 10), lab.batch_size)
    return peaks


def fit_table() -> str:
    """A text table of each GPU run's predicted peak against an 80 GB GPU."""
    lines = [f"{'run (gpu profile)':58s}{'predicted peak':>16s}{'share of 80 GB':>16s}"]
    for name, peak in gpu_run_peaks().items():
        lines.append(f"{name:58s}{peak / 1e9:>13.3f} GB{peak / GPU_BYTES:>16.1%}")
    return "\n".join(lines)
