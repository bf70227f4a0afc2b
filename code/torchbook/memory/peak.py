"""The peak of a transformers model's training step, predicted per rank.

``torchbook.memory.step`` counts what a transformers model's step stores;
``predict`` finds when the step holds the most. Besides the parameters, the
optimizer's states (and DDP's buckets, and FSDP2's gathered root), the
candidates are:

- the loss in the forward pass: every saved activation, every bf16 weight
  copy autocast keeps until the forward ends (also those a checkpointed block
  drops), the logits and their float32 copy;
- the loss's backward: the gradients of the log-probabilities and of the
  float32 logits (a chunked loss: one slice's, with its head weight's bf16
  copy made again, and the head's and hidden states' gradients summed so far);
- the head's backward: under autocast its weight gradient is made in bf16
  and then cast to float32;
- each block's backward, last first: the activations not yet freed, the
  gradients made so far, the residual stream's and the MLP's gradients, a
  checkpointed block's recomputation and, under FSDP2, the gathered
  parameters of the block and of the next, its unsharded gradients and the
  reduce-scatter's input;
- the embedding's backward (a tied embedding's gradient is added to the
  head's out of place) and the optimizer step (foreach AdamW's extra list
  the size of the parameters, as PyTorch's documentation says).

Each was checked against a fake-tensor run of transformers' model
(``torchbook.memory.check``), on the CPU's kernels, and a 4-bit base
against a measured QLoRA step (``torchbook.memory.qlora_step``). ``python -m
torchbook.memory`` (``torchbook.memory.calculator``) prints it. It builds on
``torchbook.memory.configs`` and ``torchbook.memory.step``; it imports no
torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchbook.memory import FP32, TrainingSetup
from torchbook.memory.configs import Architecture
from torchbook.memory.step import (
    ADAPTER,
    activation_terms,
    block_bytes,
    element_bytes,
    kept_bytes,
    mlp_bytes,
    state_bytes,
    trainable,
)


@dataclass(frozen=True)
class Prediction:
    """Bytes per rank by kind, the saved activations by source, and the peak."""

    parameters: int
    gradients: int
    optimizer_states: int
    gradient_buckets: int
    activations: dict[str, int]
    instants: dict[str, int]  # each busy instant of the step and its bytes

    @property
    def peak(self) -> int:
        return max(self.instants.values())

    @property
    def peak_instant(self) -> str:
        return max(self.instants, key=self.instants.get)


def predict(arch: Architecture, setup: TrainingSetup) -> Prediction:
    """Bytes per rank by kind, the saved activations, and each busy instant's total."""
    terms = activation_terms(arch, setup)
    kinds = state_bytes(arch, setup)
    sizes, tokens = element_bytes(setup), setup.tokens
    width, vocab, a = arch.hidden_size, arch.vocab_size, sizes.compute
    full = setup.trains == "all"
    shards = setup.ranks if setup.parallel == "fsdp" else 1
    grads, saved = kinds["gradients"], sum(terms.values())
    always = kinds["parameters"] + kinds["optimizer_states"] + kinds["gradient_buckets"]
    in_flight = _fsdp_in_flight(arch, setup) if setup.parallel == "fsdp" else {}
    always += in_flight.get("root", 0)
    # the head's weight (tied: the embedding's) and its gradient, as the head makes it
    head_weights = vocab * width
    head_grad = sizes.grad * head_weights * full // shards
    cast = 2 * head_weights * (sizes.autocast or sizes.master > 0) * full
    instants: dict[str, int] = {}
    logits = vocab * tokens
    if setup.trains == "frozen":  # the last hidden states, then the head's weight
        # copy and logits, then the float32 logits and log-probabilities
        hidden = (sizes.residual + a * sizes.autocast) * width * tokens
        copy = 2 * head_weights * sizes.autocast
        float_logits = (a + FP32 * (a < FP32) + FP32) * logits
        instants["forward: the head"] = always + hidden + copy + a * logits
        instants["forward: the loss"] = always + hidden + float_logits
        return _prediction(kinds, terms, instants)
    # autocast keeps each trainable weight's bf16 copy until the forward ends,
    # also the copies a checkpointed block does not save
    cached = 2 * _matmul_weights(arch, setup) * sizes.autocast
    forward = always + saved + max(0, cached - terms["bf16 weight copies"])
    forward += in_flight.get("forward", 0)
    if setup.loss_chunks == 1:
        float_copy = FP32 * logits * (a < FP32)
        instants["forward: the loss"] = forward + a * logits + float_copy
        # the gradients of the log-probabilities and of the float32 logits
        backward = always + in_flight.get("backward", 0)
        instants["backward: the loss"] = backward + saved + 2 * FP32 * logits
        after_loss = saved - terms["cross-entropy"]
        instants["backward: the head"] = (
            backward + after_loss + a * logits + cast + head_grad
        )
    else:  # one slice at a time: its bf16 weight copy, logits, log-probs, gradients
        rows = setup.batch_size * math.ceil(setup.seq_len / setup.loss_chunks)
        copy = 2 * head_weights * sizes.autocast
        instants["forward: a slice of the loss"] = (
            forward + (a + 2 * FP32) * vocab * rows
        )
        # the gradients of the head's weight and of the hidden states are summed
        # over the slices before they go on
        summed = (2 if sizes.autocast else sizes.grad) * head_weights * full // shards
        summed += sizes.residual * width * tokens
        slice_loss = copy + summed + 3 * FP32 * vocab * rows
        backward = always + in_flight.get("backward", 0)
        instants["backward: a slice of the loss"] = backward + saved + slice_loss
        slice_head = copy + 2 * summed + a * vocab * rows
        instants["backward: a slice's head"] = backward + saved + slice_head
        instants["backward: the head"] = backward + saved + cast + head_grad
    count, _ = trainable(arch, setup)
    block_grads = (count - (arch.outside_parameters() if full else 0)) // arch.layers
    block_grads = sizes.grad * block_grads // shards if full else ADAPTER * block_grads
    per_block = (terms["blocks"] + terms["bf16 weight copies"]) // arch.layers
    recompute = _recompute(arch, setup)
    # a block's backward starts in its MLP: the residual stream's gradient, two
    # gradients of the MLP's width, and its last matrix's weight gradient
    last = arch.projections()[-1]
    mlp = mlp_bytes(setup) if arch.gated else a
    transient = (sizes.residual * width + 2 * mlp * arch.intermediate_size) * tokens
    transient += (sizes.grad + 2 * sizes.autocast) * last.parameters * full // shards
    remaining = terms["blocks"] + terms["bf16 weight copies"] + terms["RoPE tables"]
    remaining += terms["embedding and ids"]
    done = head_grad
    for index in reversed(range(arch.layers)):
        instants[f"backward: block {index}"] = (
            always
            + remaining
            + done
            + transient
            + recompute
            + in_flight.get("block", 0)
        )
        remaining -= per_block
        done += block_grads
    # tied: the embedding's own gradient is added to the head's out of place
    embedding = 2 * sizes.grad * head_weights * full * arch.tied_embeddings // shards
    instants["backward: the embedding"] = (
        always + grads + embedding + terms["embedding and ids"]
    )
    if setup.optimizer != "none":
        extra = 0
        if setup.optimizer == "adamw-foreach":  # PyTorch's docs: ~sizeof(params)
            state = ADAPTER if setup.trains == "lora" else sizes.state
            extra = (
                state
                * count
                // (1 if setup.parallel in ("none", "ddp") else setup.ranks)
            )
        instants["the optimizer step"] = always + grads + extra
    return _prediction(kinds, terms, instants)


def _matmul_weights(arch: Architecture, setup: TrainingSetup) -> int:
    """Weights that go through a matmul and train: autocast caches their bf16 copies."""
    if setup.trains == "lora":
        return trainable(arch, setup)[0]
    blocks = sum(p.in_features * p.out_features for p in arch.projections())
    return arch.layers * blocks + arch.vocab_size * arch.hidden_size


def _recompute(arch: Architecture, setup: TrainingSetup) -> int:
    """Bytes a checkpointed block makes again in its backward pass."""
    if setup.checkpointing == "none":
        return 0
    per_token, copies = block_bytes(arch, setup, True)
    if setup.checkpointing == "selective":
        per_token -= kept_bytes(arch, setup)
    return per_token * setup.tokens + copies


def _fsdp_in_flight(arch: Architecture, setup: TrainingSetup) -> dict[str, int]:
    """FSDP2's unsharded tensors: the root's parameters, and the blocks' in flight.

    The root (embeddings, final norm, head) stays gathered from its forward to
    its backward. When the forward ends the last all-gather's buffer is still
    there, and the backward starts with the last block gathered (without
    ``reshard_after_forward``, every block stays gathered). A block's backward
    holds its gathered parameters and the next one's (prefetched), its
    unsharded gradients and the reduce-scatter's input.
    """
    sizes = element_bytes(setup)
    gathered = FP32 if setup.precision in ("fp32", "bf16") else 2
    block = gathered * arch.block_parameters()
    grads = arch.block_parameters() if setup.trains == "all" else 0
    kept = 0 if setup.reshard_after_forward else block * arch.layers
    return {
        "root": gathered * arch.outside_parameters(),
        "forward": kept + block,  # and the last all-gather's buffer
        "backward": max(kept, block),
        "block": max(kept, 2 * block) + (gathered + sizes.grad) * grads,
    }


def _prediction(
    kinds: dict[str, int], terms: dict[str, int], instants: dict[str, int]
) -> Prediction:
    names = ("parameters", "gradients", "optimizer_states", "gradient_buckets")
    return Prediction(*(kinds[name] for name in names), terms, instants)
