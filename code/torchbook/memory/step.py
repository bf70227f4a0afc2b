"""A transformers model's training step: what it stores per rank, counted.

``torchbook.memory`` counts the book's GPT; this module counts the models
readers fine-tune, as transformers implements them (``LlamaForCausalLM`` and
its relatives, ``GPT2LMHeadModel``), from an ``Architecture`` of
``torchbook.memory.configs``. A step is forward, loss, backward and the
optimizer's step, as transformers' ``Trainer`` runs it: the loss is kept, the
logits are not, the forward runs with ``use_cache=False`` and ``zero_grad``
sets the gradients to None. ``Setup`` says how it runs and refuses what is
meaningless (``ranks`` without a ``parallel``, an optimizer for a frozen
model).

The four kinds of memory (Rajbhandari et al. 2020) per rank:

- parameters, gradients and optimizer states (``state_bytes``), set by the
  precision (fp32 weights under bf16 autocast; pure bf16 weights, gradients
  and states; bf16 weights with float32 gradients, master weights and
  moments), what trains (everything; LoRA adapters as peft makes them, in
  float32; or nothing) and the sharding (ZeRO-1 and 2 divide the states and
  the gradients, FSDP2 everything);
- saved activations (``activation_terms``), counted operation by operation:
  an operation keeps an input only when a gradient needs it (a frozen matrix
  keeps no input, a matrix that trains does), so LoRA saves less.

Attention is counted for SDPA's fused kernels, which keep one float32
logsumexp per query and head instead of the (T, T) scores; with attention
dropout the CPU falls back to the math path, which keeps three (T, T) tensors
per head. ``device_type`` chooses the CPU's operations, which the fake-tensor
runs of ``torchbook.memory.check`` execute, or CUDA's, which only the formula
covers. ``torchbook.memory.calculator`` turns these into the step's peak. It
builds on ``torchbook.memory.configs``; it imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchbook.memory.configs import Architecture, Projection

PRECISIONS = ("bf16-autocast", "fp32", "bf16-pure", "bf16-master")
OPTIMIZERS = ("adamw", "adamw-foreach", "sgd", "none")  # adamw: fused
TRAINS = ("all", "lora", "frozen")
CHECKPOINTING = ("none", "selective", "full")
PARALLEL = ("none", "ddp", "zero1", "zero2", "fsdp")
DEVICES = ("cuda", "cpu")
LORA_DEFAULTS = {  # peft's default target modules for each family
    "llama": ("q_proj", "v_proj"),
    "mistral": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"),
    "gpt2": ("c_attn",),
}
ADAPTER = 4  # bytes: peft keeps LoRA adapters in float32 whatever the base's dtype
INDEX = 8  # an int64 token id or target
FP32 = 4


@dataclass(frozen=True)
class Setup:
    """How a step runs besides the model: batch, precision, what trains, sharding."""

    batch_size: int = 1  # rows per micro-batch, per rank
    seq_len: int = 2048  # tokens per row
    precision: str = "bf16-autocast"  # one of PRECISIONS
    optimizer: str = "adamw"  # one of OPTIMIZERS
    trains: str = "all"  # one of TRAINS
    lora_rank: int = 8
    lora_targets: tuple[str, ...] = ()  # (): peft's default for the family
    checkpointing: str = "none"  # one of CHECKPOINTING, per block
    loss_chunks: int = 1  # head and loss over this many slices of the sequence
    parallel: str = "none"  # one of PARALLEL
    ranks: int = 1  # data-parallel ranks
    bucket_view: bool = False  # DDP's gradient_as_bucket_view
    reshard_after_forward: bool = True  # FSDP2's
    device_type: str = "cuda"  # whose operations: "cuda", or "cpu" (checked)

    def __post_init__(self) -> None:
        for name, allowed in (
            ("precision", PRECISIONS),
            ("optimizer", OPTIMIZERS),
            ("trains", TRAINS),
            ("checkpointing", CHECKPOINTING),
            ("parallel", PARALLEL),
            ("device_type", DEVICES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name}={getattr(self, name)!r}; expected one of {allowed}"
                )
        for name in ("batch_size", "seq_len", "lora_rank", "loss_chunks", "ranks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        refusals = [
            (
                self.parallel == "none" and self.ranks > 1,
                f"ranks={self.ranks} with parallel='none': choose {PARALLEL[1:]}",
            ),
            (self.bucket_view and self.parallel != "ddp", "bucket_view is DDP's"),
            (
                not self.reshard_after_forward and self.parallel != "fsdp",
                "reshard_after_forward is FSDP2's",
            ),
            (self.loss_chunks > self.seq_len, "loss_chunks > seq_len"),
            (
                self.loss_chunks > 1 and self.parallel == "fsdp",
                "FSDP2 gathers the head in the root's forward, which a chunked "
                "loss runs outside",
            ),
            (
                self.trains == "frozen"
                and (self.optimizer, self.checkpointing) != ("none", "none"),
                "a frozen model has no optimizer and no backward to checkpoint "
                "(optimizer='none', checkpointing='none')",
            ),
            (
                self.trains == "frozen" and self.parallel != "none",
                "a frozen model's forward is not data-parallel training",
            ),
            (
                self.trains != "lora" and self.lora_targets,
                "lora_targets without trains='lora'",
            ),
            (
                self.trains == "lora" and self.precision == "bf16-master",
                "peft keeps LoRA adapters in float32: they are their own master "
                "copy; use bf16-pure",
            ),
            (
                self.precision == "bf16-master" and self.optimizer == "none",
                "bf16-master keeps its float32 copy for an optimizer",
            ),
        ]
        for refused, reason in refusals:
            if refused:
                raise ValueError(f"meaningless setup: {reason}")

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len


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


def element_bytes(setup: Setup) -> Bytes:
    """The element sizes of ``setup.precision``.

    bf16-master is FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)`` under ``parallel="fsdp"``: its float32 shards are
    the master copy. Otherwise the model is bf16 and its optimizer keeps the
    float32 copy, gradients accumulated in float32 beside it (as Megatron-LM
    does).
    """
    if setup.precision == "fp32":
        return Bytes(4, 4, 4, 4, 4, 0, False)
    if setup.precision == "bf16-autocast":
        return Bytes(4, 2, 4, 4, 4, 0, True)
    if setup.precision == "bf16-pure":
        return Bytes(2, 2, 2, 2, 2, 0, False)
    if setup.parallel == "fsdp":
        return Bytes(4, 2, 2, 4, 4, 0, False)
    return Bytes(2, 2, 2, 4, 4, 4, False)


def lora_targets(arch: Architecture, setup: Setup) -> tuple[str, ...]:
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


def check_setup(arch: Architecture, setup: Setup) -> None:
    """Refuse what the model cannot run or this module does not count."""
    lora_targets(arch, setup)
    if arch.family == "torchbook-gpt":
        raise ValueError("the book's GPT is predicted by torchbook.memory")
    if arch.positions and setup.seq_len > arch.positions:
        raise ValueError(
            f"seq_len={setup.seq_len} is past the {arch.positions} learned positions"
        )
    if arch.sliding_window and setup.seq_len > arch.sliding_window:
        raise ValueError(
            f"seq_len={setup.seq_len} is past the sliding window "
            f"({arch.sliding_window}): its attention mask is not counted"
        )
    if arch.gated and arch.attention_dropout > 0:
        raise ValueError("attention dropout in a Llama-family model is not counted")
    dropout = arch.attention_dropout or arch.residual_dropout or arch.embedding_dropout
    if setup.checkpointing == "selective" and dropout:
        raise ValueError("selective checkpointing is counted with dropout 0 only")


def trainable(arch: Architecture, setup: Setup) -> tuple[int, int]:
    """(parameters, parameter tensors) that train: all, the adapters, or none."""
    if setup.trains == "all":
        return arch.parameter_count(), arch.parameter_tensors()
    targets = lora_targets(arch, setup)
    chosen = [p for p in arch.projections() if p.name in targets]
    adapters = sum(setup.lora_rank * (p.in_features + p.out_features) for p in chosen)
    return arch.layers * adapters, arch.layers * 2 * len(chosen)


def state_bytes(arch: Architecture, setup: Setup) -> dict[str, int]:
    """Parameters, gradients, optimizer states and DDP's buckets, per rank."""
    sizes, (count, tensors) = element_bytes(setup), trainable(arch, setup)
    base = arch.parameter_count() * sizes.weight
    lora = setup.trains == "lora"
    grad = ADAPTER if lora else sizes.grad
    state = ADAPTER if lora else sizes.state
    moments = {"adamw": 2, "adamw-foreach": 2, "sgd": 1, "none": 0}[setup.optimizer]
    counters = FP32 * tensors if setup.optimizer.startswith("adamw") else 0
    kinds = {
        "parameters": base + (ADAPTER * count if lora else 0),
        "gradients": grad * count,
        "optimizer_states": (moments * state + sizes.master) * count + counters,
        "gradient_buckets": 0,
    }
    shards = {
        "zero1": ("optimizer_states",),
        "zero2": ("gradients", "optimizer_states"),
        "fsdp": ("parameters", "gradients", "optimizer_states"),
    }.get(setup.parallel, ())
    for kind in shards:
        kinds[kind] = math.ceil(kinds[kind] / setup.ranks)
    if setup.parallel == "ddp":  # buckets as large as the gradients, or the same memory
        kinds["gradient_buckets"] = kinds["gradients"]
        if setup.bucket_view:
            kinds["gradients"] = 0
    return kinds


class _Walk:
    """Walks a block's operations in forward order, adding up what each one saves.

    An operation saves an input when the gradient of another needs it: a matmul
    keeps its input for its weight's gradient (only if the weight trains) and its
    weight for its input's gradient (under autocast, the bf16 copy, kept only if
    the input needs a gradient). So ``grad`` flags follow which tensors need one.
    """

    def __init__(self, arch: Architecture, setup: Setup) -> None:
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
            stats = FP32 if self.setup.device_type == "cuda" else sizes.residual
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
        self.copies += 2 * p.in_features * p.out_features * (sizes.autocast and x_grad)
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
            self.per_token += width * (
                1 if self.setup.device_type == "cuda" else element
            )

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
        self.per_token += a * arch.intermediate_size * (2 * g_grad + u_grad)
        return self.matmul(down, g_grad or u_grad, [False]) or x_grad

    def gpt2_block(self, x_grad: bool) -> bool:
        """A GPT-2 block (fused q/k/v, GELU-tanh MLP, dropout after each projection)."""
        arch, a, setup = self.arch, self.sizes.compute, self.setup
        width, hidden = arch.hidden_size, arch.intermediate_size
        c_attn, c_proj, c_fc, mlp_proj = arch.projections()
        h = self.norm(x_grad)
        qkv_grad = self.matmul(c_attn, h, [False])
        math_path = setup.device_type == "cpu" and arch.attention_dropout > 0
        if qkv_grad and math_path:  # float32 q, k, v and three (T, T) per head
            scores = 3 * FP32 * arch.heads * setup.seq_len
            self.per_token += 3 * FP32 * width + scores
        elif qkv_grad:  # the q/k/v output (q, k, v are views), output, logsumexp
            self.per_token += a * 4 * width + FP32 * arch.heads
        proj_grad = self.matmul(c_proj, qkv_grad, [qkv_grad and not math_path])
        self.dropout(proj_grad, width, a)
        x_grad = x_grad or proj_grad
        fc_grad = self.matmul(c_fc, self.norm(x_grad), [False])
        if fc_grad and setup.device_type == "cuda" and self.sizes.autocast:
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


def block_bytes(arch: Architecture, setup: Setup, x_grad: bool) -> tuple[int, int]:
    """(bytes per token, bf16 weight copies) one un-checkpointed block saves."""
    walk = _Walk(arch, setup)
    walk.block(x_grad)
    return walk.per_token, walk.copies


def kept_bytes(arch: Architecture, setup: Setup) -> int:
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


def activation_terms(arch: Architecture, setup: Setup) -> dict[str, int]:
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
        mask = 1 if setup.device_type == "cuda" else sizes.residual
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
