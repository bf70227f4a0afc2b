"""Where the book's GPT's training memory goes, predicted from its shape.

It builds on ``torchbook.models`` (``GPTConfig`` and the ``GPT`` whose saved
tensors the formula counts, one by one), reading only a config's sizes, so it
imports no torch; the step is a ``torchbook.memory.TrainingSetup``.
``torchbook.memory.measure`` measures the same quantities without any
formula. Parameters, gradients and AdamW's moments are float32 (16 bytes per
parameter); FSDP's all-gathered copy of one block is not counted.

The activation formula is derived for this GPT tensor by tensor (see
``activation_terms``), in the way Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models") derive 34·s·b·h + 5·a·s²·b bytes per
layer for GPT-3. Their (T, T) term, the softmax and dropout of the attention
scores, appears here in two cases. When attention falls back to PyTorch's
"math" path, which keeps the scores (on the CPU, when attention dropout is on;
CUDA's fused kernels handle dropout themselves). And for packed rows, whose
boolean (B, 1, T, T) document mask becomes an additive mask that the CPU's
fused kernel saves in every block (``packed_terms``). Otherwise the fused
kernels (flash, memory-efficient, and the CPU's flash kernel) keep just one
logsumexp per query and head.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from torchbook.memory import (
    AUTOCAST_BYTES,
    FP32,
    INDEX,
    OPTIMIZER_STATES,
    SHARDED,
    MemoryBreakdown,
    TrainingSetup,
)

if TYPE_CHECKING:  # the formula reads a config's sizes; it needs no torch
    from torchbook.models import GPTConfig

# The MLP's width (torchbook.models.MLP_EXPANSION, which a test compares).
MLP_EXPANSION = 4


def check_gpt(setup: TrainingSetup) -> None:
    """Refuse what the book's GPT formula does not count; it trains every weight."""
    counted = {
        "precision": ("fp32", "bf16", "fp16"),
        "optimizer": ("adamw", "sgd"),
        "trains": ("all",),
        "base": ("auto",),
        "reshard_after_forward": (True,),
    }
    for name, allowed in counted.items():
        if getattr(setup, name) not in allowed:
            raise ValueError(
                f"{name}={getattr(setup, name)!r}: the book's GPT formula counts full "
                "training of float32 weights (fp32, bf16 or fp16 autocast) with "
                "fused AdamW or SGD; a transformers model's step is counted by "
                "torchbook.memory.peak"
            )


def parameter_count(config: GPTConfig) -> int:
    """Parameters of ``GPT(config)``: tied embedding, n_layer blocks, last LayerNorm."""
    width, hidden = config.d_model, MLP_EXPANSION * config.d_model
    block = (
        2 * 2 * width  # two LayerNorms, weight and bias
        + (width * 3 * width + 3 * width)  # qkv
        + (width * width + width)  # attention projection
        + (width * hidden + hidden)  # MLP
        + (hidden * width + width)
    )
    return config.vocab_size * width + config.n_layer * block + 2 * width


def matmul_parameter_count(config: GPTConfig) -> int:
    """Weights used in matmuls: every block's four matrices and the tied head.

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


def block_bytes_per_token(config: GPTConfig, setup: TrainingSetup) -> int:
    """Bytes one block saves per token.

    With C = d_model, H = n_head and a = the compute dtype's bytes:

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

    Checkpointed, a block keeps its float32 input (4C), and selectively also
    the outputs of its four matmuls (a·9C) and of attention (aC + 4H).
    """
    check_gpt(setup)
    width, heads, steps = config.d_model, config.n_head, setup.seq_len
    low = AUTOCAST_BYTES[setup.precision]
    if setup.checkpointing == "full":
        return FP32 * width
    if setup.checkpointing == "selective":
        if config.dropout > 0:
            raise ValueError("selective checkpointing is predicted for dropout 0 only")
        return FP32 * width + low * (6 + MLP_EXPANSION) * width + FP32 * heads
    dropout = config.dropout > 0
    mask = (1 if setup.kernels == "cuda" else low) if dropout else 0
    if dropout and setup.kernels == "cpu":  # SDPA's math path
        attention = 3 * FP32 * width + 3 * FP32 * heads * steps + low * width
        if setup.batch_size == 1 and low == FP32:
            attention += 2 * FP32 * width  # one float32 row: views keep two more
    else:  # a fused kernel
        attention = low * 6 * width + FP32 * heads
    return (
        2 * FP32 * width
        + 4 * FP32  # LayerNorm inputs and statistics
        + low * (2 * width + 2 * MLP_EXPANSION * width)  # qkv, fc inputs; fc, GELU out
        + attention
        + 2 * mask * width
    )


def packed_terms(config: GPTConfig, setup: TrainingSetup) -> tuple[int, int]:
    """(bytes every block saves, bytes saved once) for rows of packed documents.

    Packed rows pass position ids and document ids (``torchbook.chat``). Each
    token's RoPE rows are gathered from the tables: float32 cos and sin of
    head_size each, saved once for all blocks. The (B, 1, T, T) boolean mask
    of "same document and causal" goes to SDPA, which turns it into an
    additive mask in the queries' dtype (a bytes per entry); the CPU's fused
    kernel saves that in every block, measured, and CUDA's memory-efficient
    kernel, which takes masks, is counted the same (unmeasured). The math
    path (the CPU with dropout) saves nothing more; a checkpointed block keeps
    only the boolean mask, once, as an input to recompute from.
    """
    if not setup.packed:
        return 0, 0
    rows = FP32 * 2 * config.head_size * setup.tokens  # gathered cos and sin
    entries = setup.batch_size * setup.seq_len**2
    if setup.checkpointing != "none":
        return 0, rows + entries  # the boolean mask, kept once
    if config.dropout > 0 and setup.kernels == "cpu":  # the math path
        return 0, rows
    return AUTOCAST_BYTES[setup.precision] * entries, rows


def activation_terms(config: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
    """Bytes autograd saves during one forward pass, by where they come from.

    Blocks: ``block_bytes_per_token`` (and, for packed rows, each block's
    mask: ``packed_terms``). Outside them: the token ids, the embedding's
    dropout mask, the final LayerNorm (4C + 8 + aC) and cross-entropy's
    float32 log-probabilities (4V) and int64 targets. With a chunked loss only
    the head's float32 input (4C) and the targets are kept: each slice's
    logits are made again in the backward pass. Under autocast each matmul
    weight is also saved as its low-precision copy (2 bytes a weight), except
    where it is recomputed (checkpointed blocks, a chunked head).
    """
    tokens = setup.tokens
    width, vocab = config.d_model, config.vocab_size
    low = AUTOCAST_BYTES[setup.precision]
    copied = matmul_parameter_count(config)
    if setup.checkpointing != "none":
        copied = vocab * width
    if setup.loss_chunks > 1:
        copied -= vocab * width
        head = tokens * (FP32 * width + 2 * FP32 + FP32 * width)
        loss = tokens * INDEX
    else:
        head = tokens * (FP32 * width + 2 * FP32 + low * width)
        loss = tokens * (FP32 * vocab + INDEX) + FP32
    mask = 1 if setup.kernels == "cuda" else FP32
    embedding_mask = mask * width if config.dropout > 0 else 0
    per_block, once = packed_terms(config, setup)
    blocks = tokens * block_bytes_per_token(config, setup) + per_block
    return {
        "blocks": config.n_layer * blocks,
        "embedding and ids": tokens * (INDEX + embedding_mask),
        "packed rows' positions and mask": once,
        "final norm and head": head,
        "cross-entropy": loss,
        "autocast weight copies": 2 * copied if low < FP32 else 0,
    }


def predict_memory(config: GPTConfig, setup: TrainingSetup) -> MemoryBreakdown:
    """Bytes per rank: parameters, gradients, optimizer states, buckets, activations."""
    check_gpt(setup)
    count = parameter_count(config)
    moments = OPTIMIZER_STATES[setup.optimizer]
    counters = parameter_tensor_count(config) if setup.optimizer == "adamw" else 0
    sizes = {
        "parameters": FP32 * count,
        "gradients": FP32 * count,
        "optimizer_states": moments * FP32 * count + FP32 * counters,
    }
    for kind in SHARDED[setup.parallel]:
        sizes[kind] = math.ceil(sizes[kind] / setup.ranks)
    buckets = FP32 * count if setup.parallel == "ddp" else 0
    if buckets and setup.gradient_as_bucket_view:  # the gradients live in the buckets
        sizes["gradients"] = 0
    return MemoryBreakdown(
        activations=sum(activation_terms(config, setup).values()),
        gradient_buckets=buckets,
        **sizes,
    )


def loss_backward_bytes(config: GPTConfig, setup: TrainingSetup) -> int:
    """What the loss's backward holds besides the saved activations: the logits' share.

    Unchunked: cross-entropy's two float32 gradients of V per token (and in the
    tutorial loop the logits themselves, a·V, alive since the forward). Chunked:
    one slice's recomputed log-probabilities and their two gradients (3 x 4V
    per token of the slice), the head's weight gradient summed over the slices
    before, the hidden states' gradient summed likewise (4C per token), and
    under autocast the head weight's 16-bit copy, which each slice makes again.
    """
    tokens, vocab = setup.tokens, config.vocab_size
    if setup.loss_chunks > 1:
        rows = setup.batch_size * math.ceil(setup.seq_len / setup.loss_chunks)
        head = vocab * config.d_model
        copy = 2 * head if AUTOCAST_BYTES[setup.precision] < FP32 else 0
        hidden = FP32 * config.d_model * tokens
        return 3 * FP32 * rows * vocab + FP32 * head + copy + hidden
    held = AUTOCAST_BYTES[setup.precision] if setup.loop == "tutorial" else 0
    return (2 * FP32 + held) * tokens * vocab


def predict_peak(config: GPTConfig, setup: TrainingSetup) -> int:
    """Bytes at a training step's busiest instant, once the optimizer has its states.

    Parameters, optimizer states and DDP's buckets are always there. The
    candidates are:

    - the start of the backward pass: every saved activation, plus the logits'
      share (``loss_backward_bytes``);
    - each block's backward, last block first, with the activations not yet
      freed, the gradients made so far and a checkpointed block's recomputed
      activations: its MLP's backward (the second matrix's weight gradient and
      two gradients of the MLP's width, that matrix's saved input freed), and
      on SDPA's math path its attention's (the block's gradients, two
      residual-stream gradients and the gradient of one (T, T) tensor per head,
      less the block's MLP tensors, freed by then);
    - the optimizer step: every gradient.

    Gradients are None until the backward pass (``zero_grad(set_to_none=True)``).
    """
    memory = predict_memory(config, setup)
    terms = activation_terms(config, setup)
    tokens = setup.tokens
    width, low = config.d_model, AUTOCAST_BYTES[setup.precision]
    grad_share = memory.gradients / (FP32 * parameter_count(config))
    block_params = (
        parameter_count(config) - config.vocab_size * width - 2 * width
    ) // config.n_layer
    block_grads = FP32 * block_params * grad_share
    always = memory.parameters + memory.optimizer_states + memory.gradient_buckets
    recompute = 0  # what a block's backward holds beyond the saved tensors
    attention = 0  # the math path's attention backward, beyond those
    if setup.checkpointing != "none":  # the block's saved tensors, made again
        plain = replace(setup, checkpointing="none")
        recompute = tokens * block_bytes_per_token(config, plain)
        recompute += packed_terms(config, plain)[0]
        if setup.checkpointing == "selective":  # less what was kept, but the two
            # projections' outputs, which a plain block does not keep
            kept = block_bytes_per_token(config, setup) - 2 * low * width
            recompute -= tokens * kept
        if low < FP32:  # and the block's weights' low-precision copies
            matmuls = matmul_parameter_count(config) - config.vocab_size * width
            recompute += 2 * matmuls // config.n_layer
    if config.dropout > 0 and setup.kernels == "cpu":
        # The math path's backward peaks in attention, holding the gradient of one
        # (T, T) tensor per head; the block's MLP tensors are freed by then.
        mask = low * width  # the MLP's dropout mask
        mlp_saved = (
            FP32 * width + 2 * FP32 + low * (width + 2 * MLP_EXPANSION * width) + mask
        )
        attention = FP32 * config.n_head * setup.seq_len - mlp_saved
        attention = max(0, attention * tokens) + 2 * FP32 * width * tokens
    instants = [always + memory.activations + loss_backward_bytes(config, setup)]
    if setup.loop == "tutorial":  # the logits stay until the step ends
        always += tokens * config.vocab_size * low
    remaining = (
        memory.activations - terms["cross-entropy"] - terms["final norm and head"]
    )
    # tied head and final LayerNorm
    grads = FP32 * (config.vocab_size * width + 2 * width) * grad_share
    mlp_width = MLP_EXPANSION * width
    second_matrix = FP32 * (mlp_width * width + width) * grad_share
    for _ in range(config.n_layer):
        held = always + remaining + grads + recompute
        instants.append(held + second_matrix + low * mlp_width * tokens)
        if attention:
            instants.append(held + block_grads + attention)
        remaining -= terms["blocks"] // config.n_layer
        grads += block_grads
    instants.append(always + memory.gradients)
    return int(max(instants))


def kv_cache_bytes(
    config: GPTConfig,
    batch_size: int,
    seq_len: int,
    element_bytes: int,
    kv_heads: int | None = None,
) -> int:
    """Bytes of a KV cache: a key and a value per layer, KV head and position.

    2 x n_layer x kv_heads x head_size x element_bytes per token. With
    grouped-query attention (Ainslie et al. 2023) ``kv_heads`` < n_head: query
    heads share each key/value head, and the cache shrinks by n_head / kv_heads.
    """
    kv_heads = config.n_head if kv_heads is None else kv_heads
    if config.n_head % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide n_head={config.n_head}")
    per_token = 2 * config.n_layer * kv_heads * config.head_size * element_bytes
    return per_token * batch_size * seq_len
