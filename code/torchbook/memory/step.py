"""A transformers model's training step: what it stores per rank, counted.

``torchbook.memory.gpt`` counts the book's GPT; this module counts the models
readers fine-tune, as transformers implements them (``LlamaForCausalLM`` and
its relatives, ``GPT2LMHeadModel``), from an ``Architecture`` of
``torchbook.memory.configs`` and a ``torchbook.memory.TrainingSetup``. A step
is forward, loss, backward and the optimizer's step, as transformers'
``Trainer`` runs it: the loss is kept, the logits are not, the forward runs
with ``use_cache=False`` and ``zero_grad`` sets the gradients to None.
``check_setup`` refuses what this module does not count.

The four kinds of memory (Rajbhandari et al. 2020) per rank:

- parameters, gradients and optimizer states (``state_bytes``), set by the
  precision (fp32 weights under bf16 autocast; pure bf16 weights, gradients
  and states; bf16 weights with float32 gradients, master weights and
  moments), what trains (everything; LoRA adapters as peft makes them, in
  float32; or nothing), the base's storage (QLoRA's 4-bit NF4 base, as
  bitsandbytes stores it) and the sharding (ZeRO-1 and 2 divide the states
  and the gradients, FSDP2 everything);
- saved activations (``activation_terms``), counted operation by operation:
  an operation keeps an input only when a gradient needs it (a frozen matrix
  keeps no input, a matrix that trains does), so LoRA saves less.

Attention is counted for SDPA's fused kernels, which keep one float32
logsumexp per query and head instead of the (T, T) scores; with attention
dropout the CPU falls back to the math path, which keeps three (T, T) tensors
per head. ``kernels`` chooses the CPU's operations, which the fake-tensor
runs of ``torchbook.memory.check`` execute, or CUDA's, which only the formula
covers. ``torchbook.memory.peak`` turns these into the step's peak.
It builds on ``torchbook.memory.configs``; it imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchbook.memory import (
    FP32,
    INDEX,
    OPTIMIZER_STATES,
    SHARDED,
    TrainingSetup,
)
from torchbook.memory.configs import Architecture, Projection

TRANSFORMERS_PRECISIONS = ("fp32", "bf16", "bf16-pure", "bf16-master")
LORA_DEFAULTS = {  # peft's default target modules for each family
    "llama": ("q_proj", "v_proj"),
    "mistral": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"),
    "gpt2": ("c_attn",),
}
ADAPTER = 4  # bytes: peft keeps LoRA adapters in float32 whatever the base's dtype
# QLoRA's 4-bit base as bitsandbytes stores it (Dettmers et al. 2023): two NF4
# codes per byte; one absmax scale per block of 64 weights, itself quantized to
# 8 bits in blocks of 256 scales with a float32 scale each (double quantization);
# and per matrix the 16 NF4 levels, the 256 levels of the scales' 8-bit code and
# the scales' mean, all float32. Computed in bf16 (bnb_4bit_compute_dtype).
NF4_BLOCK = 64
NF4_SCALE_BLOCK = 256
NF4_PER_MATRIX = FP32 * (16 + 256 + 1)


@dataclass(frozen=True)
class Bytes:
    """Bytes per number of each kind of tensor, as the precision (and FSDP2) sets."""

    weight: int  # parameters as stored (FSDP2: its shards)
    compute: int  # a matmul's output; under FSDP2 also its gathered parameters
    residual: int  # the residual stream between blocks
    grad: int
    state: int  # each optimizer moment
    master: int  # a float32 master copy beside the optimizer's moments
    autocast: bool  # fp32 weights, each cast to bf16 by its matmul (and kept)


def element_bytes(setup: TrainingSetup) -> Bytes:
    """The element sizes of ``setup.precision``.

    bf16-master is FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)`` under ``parallel="fsdp"``: its float32 shards are
    the master copy. Otherwise the model is bf16 and its optimizer keeps the
    float32 copy, gradients accumulated in float32 beside it (as Megatron-LM
    does).
    """
    if setup.precision == "fp32":
        return Bytes(4, 4, 4, 4, 4, 0, False)
    if setup.precision == "bf16":  # autocast over float32 weights
        return Bytes(4, 2, 4, 4, 4, 0, True)
    if setup.precision == "bf16-pure":
        return Bytes(2, 2, 2, 2, 2, 0, False)
    if setup.parallel == "fsdp":
        return Bytes(4, 2, 2, 4, 4, 0, False)
    return Bytes(2, 2, 2, 4, 4, 4, False)


def mlp_bytes(setup: TrainingSetup) -> int:
    """Bytes per number of the MLP's gate and up outputs (a Llama's).

    A matmul's output, except that bitsandbytes' 4-bit layer casts its output
    back to its input's dtype: float32 under autocast, where a norm feeds it
    float32 (measured). Attention's inputs are cast to bf16 by autocast anyway.
    """
    sizes = element_bytes(setup)
    return sizes.residual if setup.base == "nf4" and sizes.autocast else sizes.compute


def lora_targets(arch: Architecture, setup: TrainingSetup) -> tuple[str, ...]:
    """The projections that get adapters; refuses a name the block has not."""
    if setup.trains != "lora":
        return ()
    targets = setup.lora_targets or LORA_DEFAULTS.get(arch.family, ())
    names = [p.name for p in arch.projections()]
    if "all-linear" in targets:  # peft's shorthand: every matrix but the head
        return tuple(dict.fromkeys(names))
    unknown = [name for name in targets if name not in names]
    if unknown or not targets:
        raise ValueError(
            f"LoRA targets {list(unknown) or '()'} are not {arch.family} projections; "
            f"expected some of {sorted(set(names))} or all-linear"
        )
    return tuple(targets)


def check_setup(arch: Architecture, setup: TrainingSetup) -> None:
    """Refuse what the model cannot run or this module does not count."""
    lora_targets(arch, setup)
    if arch.family == "torchbook-gpt":
        raise ValueError("the book's GPT is predicted by torchbook.memory.gpt")
    refusals = [
        (
            setup.precision not in TRANSFORMERS_PRECISIONS,
            f"precision={setup.precision!r}: a transformers model is counted in "
            f"{', '.join(TRANSFORMERS_PRECISIONS)}",
        ),
        (setup.loop != "trainer", "the tutorial loop is the book's GPT's"),
        (setup.packed, "packed rows are counted for the book's GPT only"),
        (
            setup.base == "nf4" and not arch.gated,
            "base='nf4' is counted for Llama, Mistral and Qwen2 models",
        ),
        (
            setup.base == "nf4" and any(p.bias for p in arch.projections()),
            "base='nf4' is counted for projections without biases",
        ),
        (
            bool(arch.positions) and setup.seq_len > arch.positions,
            f"seq_len={setup.seq_len} is past the {arch.positions} learned positions",
        ),
        (
            bool(arch.sliding_window) and setup.seq_len > (arch.sliding_window or 0),
            f"seq_len={setup.seq_len} is past the sliding window "
            f"({arch.sliding_window}): its attention mask is not counted",
        ),
        (
            arch.gated and arch.attention_dropout > 0,
            "attention dropout in a Llama-family model is not counted",
        ),
        (
            setup.checkpointing == "selective"
            and bool(
                arch.attention_dropout
                or arch.residual_dropout
                or arch.embedding_dropout
            ),
            "selective checkpointing is counted with dropout 0 only",
        ),
    ]
    for refused, reason in refusals:
        if refused:
            raise ValueError(reason)


def nf4_bytes(weights: int) -> int:
    """Bytes bitsandbytes stores for a matrix of ``weights`` in double-quantized NF4."""
    scales = math.ceil(weights / NF4_BLOCK)  # one 8-bit absmax per block
    second = math.ceil(scales / NF4_SCALE_BLOCK)  # one float32 per block of scales
    return math.ceil(weights / 2) + scales + FP32 * second + NF4_PER_MATRIX


def trainable(arch: Architecture, setup: TrainingSetup) -> tuple[int, int]:
    """(parameters, parameter tensors) that train: all, the adapters, or none."""
    if setup.trains == "all":
        return arch.parameter_count(), arch.parameter_tensors()
    targets = lora_targets(arch, setup)
    chosen = [p for p in arch.projections() if p.name in targets]
    adapters = sum(setup.lora_rank * (p.in_features + p.out_features) for p in chosen)
    return arch.layers * adapters, arch.layers * 2 * len(chosen)


def parameter_bytes(arch: Architecture, setup: TrainingSetup) -> dict[str, int]:
    """The parameters' bytes by storage: the weights as stored, and the adapters.

    With ``base="nf4"`` every block projection is stored in 4 bits
    (``nf4_bytes``); transformers leaves the embeddings, the norms and the
    head (``lm_head``, and whatever is tied to it) in the model's dtype.
    """
    sizes, lora = element_bytes(setup), setup.trains == "lora"
    adapters = ADAPTER * trainable(arch, setup)[0] if lora else 0
    if setup.base != "nf4":
        return {"weights": arch.parameter_count() * sizes.weight, "adapters": adapters}
    matrices = [p.in_features * p.out_features for p in arch.projections()]
    quantized = arch.layers * sum(nf4_bytes(weights) for weights in matrices)
    kept = arch.parameter_count() - arch.layers * sum(matrices)
    return {
        "4-bit base weights": quantized,
        "unquantized weights": kept * sizes.weight,
        "adapters": adapters,
    }


def state_bytes(arch: Architecture, setup: TrainingSetup) -> dict[str, int]:
    """Parameters, gradients, optimizer states and DDP's buckets, per rank."""
    check_setup(arch, setup)
    sizes, (count, tensors) = element_bytes(setup), trainable(arch, setup)
    lora = setup.trains == "lora"
    grad = ADAPTER if lora else sizes.grad
    state = ADAPTER if lora else sizes.state
    moments = OPTIMIZER_STATES[setup.optimizer]
    counters = FP32 * tensors if setup.optimizer.startswith("adamw") else 0
    kinds = {
        "parameters": sum(parameter_bytes(arch, setup).values()),
        "gradients": grad * count,
        "optimizer_states": (moments * state + sizes.master) * count + counters,
        "gradient_buckets": 0,
    }
    for kind in SHARDED[setup.parallel]:
        kinds[kind] = math.ceil(kinds[kind] / setup.ranks)
    if setup.parallel == "ddp":  # buckets as large as the gradients, or the same memory
        kinds["gradient_buckets"] = kinds["gradients"]
        if setup.gradient_as_bucket_view:
            kinds["gradients"] = 0
    return kinds


class _Walk:
    """Walks a block's operations in forward order, adding up what each one saves.

    An operation saves an input when the gradient of another needs it: a matmul
    keeps its input for its weight's gradient (only if the weight trains) and its
    weight for its input's gradient (under autocast, the bf16 copy, kept only if
    the input needs a gradient). So ``grad`` flags follow which tensors need one.
    """

    def __init__(self, arch: Architecture, setup: TrainingSetup) -> None:
        self.arch, self.setup = arch, setup
        self.sizes = element_bytes(setup)
        self.trains = setup.trains == "all"
        self.targets = lora_targets(arch, setup)
        self.per_token = 0  # bytes saved per token
        self.copies = 0  # bytes of bf16 weight copies (autocast)
        self.rope = False  # whether RoPE's cos and sin tables are saved

    def norm(self, x_grad: bool) -> bool:
        """RMSNorm keeps its float32 input and 1/rms; LayerNorm its input, mean, rstd.

        Both keep their normalised input only when their weight trains (RMSNorm's
        ``weight * x``; LayerNorm's kernel keeps its input either way).
        """
        width, sizes = self.arch.hidden_size, self.sizes
        if self.arch.gated:
            self.per_token += (FP32 * width + FP32) * x_grad
            self.per_token += sizes.residual * width * self.trains
        elif x_grad or self.trains:  # mean and rstd: float32 on CUDA (unmeasured),
            # the input's dtype on the CPU (measured)
            stats = FP32 if self.setup.kernels == "cuda" else sizes.residual
            self.per_token += sizes.residual * width + 2 * stats
        return x_grad or self.trains

    def matmul(self, p: Projection, x_grad: bool, shared: list[bool]) -> bool:
        """A projection (and its LoRA adapter); ``shared[0]``: its input is kept.

        Under autocast a float32 input is cast to bf16 by each matmul that reads
        it, so each keeps its own copy; otherwise the matmuls share one tensor.
        """
        sizes, rank = self.sizes, self.setup.lora_rank
        own_copy = sizes.autocast and p.fed_by_norm
        width = sizes.residual if p.fed_by_norm else sizes.compute
        if self.trains and own_copy:
            self.per_token += sizes.compute * p.in_features
        elif self.trains and not shared[0]:
            self.per_token += width * p.in_features
            shared[0] = True
        # bitsandbytes dequantizes a 4-bit weight inside its own operation, which
        # keeps the packed weight only: autocast makes no copy of it
        copy = sizes.autocast and x_grad and self.setup.base != "nf4"
        self.copies += 2 * p.in_features * p.out_features * copy
        adapter = p.name in self.targets
        if adapter and sizes.autocast:  # peft casts the input to float32, autocast
            self.per_token += 2 * (p.in_features + rank)  # to bf16: A's own copy
            self.copies += 2 * rank * (p.in_features * x_grad + p.out_features)
        elif adapter and sizes.compute == FP32:
            if not shared[0]:
                self.per_token += FP32 * p.in_features
                shared[0] = True
            self.per_token += FP32 * rank
        elif adapter:  # peft casts the bf16 input to its float32 adapters
            self.per_token += ADAPTER * (p.in_features + rank)
        return x_grad or self.trains or adapter

    def dropout(self, x_grad: bool, width: int, element: int) -> None:
        """A dropout mask: the input's dtype on the CPU; on CUDA (unmeasured) bools."""
        if self.arch.residual_dropout > 0 and x_grad:
            self.per_token += width * (1 if self.setup.kernels == "cuda" else element)

    def llama_block(self, x_grad: bool) -> bool:
        """A Llama, Mistral or Qwen2 layer; returns whether its output needs grad."""
        arch, a = self.arch, self.sizes.compute
        q, k, v, o, gate, up, down = arch.projections()
        h = self.norm(x_grad)
        shared = [False]
        q_grad, k_grad, v_grad = (self.matmul(p, h, shared) for p in (q, k, v))
        self.rope = self.rope or q_grad or k_grad  # q * cos keeps cos (and sin)
        attention = q_grad or k_grad or v_grad
        if attention:  # SDPA keeps q, k, v, its output and the logsumexp
            queries, keys = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
            self.per_token += a * 2 * (queries + keys) + FP32 * arch.heads
        x_grad = self.matmul(o, attention, [attention]) or x_grad
        h = self.norm(x_grad)
        shared = [False]
        g_grad, u_grad = (self.matmul(p, h, shared) for p in (gate, up))
        # silu keeps gate's output; the product keeps silu's and up's outputs
        mlp = mlp_bytes(self.setup)
        self.per_token += mlp * arch.intermediate_size * (2 * g_grad + u_grad)
        return self.matmul(down, g_grad or u_grad, [False]) or x_grad

    def gpt2_block(self, x_grad: bool) -> bool:
        """A GPT-2 block (fused q/k/v, GELU-tanh MLP, dropout after each projection)."""
        arch, a, setup = self.arch, self.sizes.compute, self.setup
        width, hidden = arch.hidden_size, arch.intermediate_size
        c_attn, c_proj, c_fc, mlp_proj = arch.projections()
        h = self.norm(x_grad)
        qkv_grad = self.matmul(c_attn, h, [False])
        math_path = setup.kernels == "cpu" and arch.attention_dropout > 0
        if qkv_grad and math_path:  # float32 q, k, v and three (T, T) per head
            scores = 3 * FP32 * arch.heads * setup.seq_len
            self.per_token += 3 * FP32 * width + scores
        elif qkv_grad:  # the q/k/v output (q, k, v are views), output, logsumexp
            self.per_token += a * 4 * width + FP32 * arch.heads
        proj_grad = self.matmul(c_proj, qkv_grad, [qkv_grad and not math_path])
        self.dropout(proj_grad, width, a)
        x_grad = x_grad or proj_grad
        fc_grad = self.matmul(c_fc, self.norm(x_grad), [False])
        if fc_grad and setup.kernels == "cuda" and self.sizes.autocast:
            # CUDA's autocast runs pow in float32 (PyTorch's autocast op list):
            # float32 pow input, tanh, 1 + tanh; bf16 0.5x
            self.per_token += (3 * FP32 + 2) * hidden
        elif fc_grad:  # GELU-tanh keeps its input, 0.5x, tanh(...) and 1 + tanh
            self.per_token += 4 * a * hidden
        out_grad = self.matmul(mlp_proj, fc_grad, [False])
        self.dropout(out_grad, width, a)
        return x_grad or out_grad

    def block(self, x_grad: bool) -> bool:
        return self.llama_block(x_grad) if self.arch.gated else self.gpt2_block(x_grad)


def block_bytes(
    arch: Architecture, setup: TrainingSetup, x_grad: bool
) -> tuple[int, int]:
    """(bytes per token, bf16 weight copies) one un-checkpointed block saves."""
    walk = _Walk(arch, setup)
    walk.block(x_grad)
    return walk.per_token, walk.copies


def kept_bytes(arch: Architecture, setup: TrainingSetup) -> int:
    """Bytes per token a selectively checkpointed block keeps besides its input.

    The policy of ``torchbook.recompute``: every matmul's output (adapters'
    too) and attention's output and logsumexp; the rest is recomputed.
    """
    a, targets = element_bytes(setup).compute, lora_targets(arch, setup)
    outputs = sum(p.out_features for p in arch.projections())
    adapters = sum(
        setup.lora_rank + p.out_features
        for p in arch.projections()
        if p.name in targets
    )
    attention = a * arch.heads * arch.head_dim + FP32 * arch.heads
    return a * (outputs + adapters) + attention


def activation_terms(arch: Architecture, setup: TrainingSetup) -> dict[str, int]:
    """Bytes autograd keeps for the backward pass, by where they come from.

    Blocks: ``_Walk`` (a checkpointed block keeps its input, and selectively
    also ``kept_bytes``). Outside them: the token ids (and GPT-2's position
    ids and embedding dropout mask) while the embedding trains; RoPE's cos
    and sin (one (T, head_dim) pair for all blocks); the final norm and the
    head's input; cross-entropy's float32 log-probabilities and targets. A
    chunked loss keeps only the head's input and the targets: each slice's
    logits are made again in the backward pass. Under autocast every matmul
    whose input needs a gradient keeps its weight's bf16 copy.
    """
    check_setup(arch, setup)
    tokens, sizes = setup.tokens, element_bytes(setup)
    width, vocab = arch.hidden_size, arch.vocab_size
    full = setup.trains == "all"
    first, first_copies = block_bytes(arch, setup, full)
    later, copies = block_bytes(arch, setup, True)
    walk = _Walk(arch, setup)
    needs_grad = walk.block(full) or full
    if arch.layers > 1:
        walk.block(needs_grad)
    if setup.checkpointing != "none":
        kept = sizes.residual * width  # each block's input
        if setup.checkpointing == "selective":
            kept += kept_bytes(arch, setup)
        blocks, first_copies, copies = arch.layers * kept, 0, 0
    else:
        blocks = first + (arch.layers - 1) * later
    ids = INDEX * tokens * full + INDEX * setup.seq_len * (arch.positions > 0) * full
    if arch.embedding_dropout > 0 and full:
        mask = 1 if setup.kernels == "cuda" else sizes.residual
        ids += mask * width * tokens
    final = _Walk(arch, setup)
    final.norm(needs_grad)
    head = final.per_token * tokens
    if setup.loss_chunks > 1:  # each slice's checkpoint keeps its input
        head += sizes.residual * width * tokens * needs_grad
        loss = INDEX * tokens * needs_grad
    else:  # the head keeps its input if its weight trains
        head += (
            (sizes.compute if sizes.autocast else sizes.residual)
            * width
            * tokens
            * full
        )
        loss = (FP32 * vocab * tokens + INDEX * tokens + FP32) * needs_grad
    head_copy = 2 * vocab * width * (sizes.autocast and needs_grad)
    head_copy *= setup.loss_chunks == 1
    rope = 2 * setup.seq_len * arch.head_dim * sizes.residual * walk.rope
    return {
        "blocks": blocks * tokens,
        "embedding and ids": ids,
        "RoPE tables": rope if arch.gated else 0,
        "final norm and head": head,
        "cross-entropy": loss,
        "bf16 weight copies": first_copies + (arch.layers - 1) * copies + head_copy,
    }
