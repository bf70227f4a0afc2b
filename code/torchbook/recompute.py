"""Selective activation checkpointing: keep costly outputs, recompute the rest.

Full checkpointing (``GPTConfig(activation_checkpointing=True)``) keeps only
each block's input and runs the whole block again in the backward pass: one
more forward of every matmul. Selective checkpointing chooses per operation.
The policy here is PyTorch's per-operation selective checkpointing, applied to
each block as torchtitan's op-level option applies it: the outputs of the
matmuls and of attention are kept, and everything else (LayerNorm, GELU, RoPE,
the residual adds, autocast's weight copies) is recomputed, which costs a few
operations per number instead of a multiply-add per weight. torchtitan's own
policy keeps every second matmul's output only and recomputes the others,
halving what the matmuls keep for running half of them again; this one keeps
them all. (The selective
recomputation of Korthikanti et al. 2022 chooses the other way round: it
recomputes attention's core, the scores, their softmax and dropout and the
product with the values, whose activations are large and FLOPs few.)

It uses ``torch.utils.checkpoint``'s policy API: a policy function answers,
for each operation the block runs, whether its output is saved or recomputed,
and ``create_selective_checkpoint_contexts`` turns it into the contexts
``checkpoint`` takes. ``checkpoint_wrapper`` (as torchtitan uses it) wraps each
block so that the model's ``state_dict`` keys do not change. It builds on
``torchbook.models`` (the GPT whose blocks it wraps).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from torchbook.models import GPT

aten = torch.ops.aten
# Matmuls (a Linear on a (B, T, C) input runs addmm) and the fused attention kernels.
SAVED_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}


def keep_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    """The policy: save the outputs of ``SAVED_OPS``, recompute every other one."""
    if op in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_blocks_selectively(model: GPT) -> GPT:
    """Wrap each block of ``model`` in selective checkpointing, in place; returns it.

    The random state is saved for the recomputation only when dropout is on,
    so that a recomputed dropout mask equals the first one.
    """
    if model.config.activation_checkpointing:
        raise ValueError(
            "checkpoint_blocks_selectively: the model already checkpoints whole "
            "blocks (GPTConfig.activation_checkpointing=True); choose one"
        )
    for index, block in enumerate(model.blocks):
        model.blocks[index] = checkpoint_wrapper(
            block,
            context_fn=partial(create_selective_checkpoint_contexts, keep_matmuls),
            preserve_rng_state=model.config.dropout > 0,
            respect_saved_tensors_hooks=True,  # so a pack hook counts what it saves
        )
    return model
