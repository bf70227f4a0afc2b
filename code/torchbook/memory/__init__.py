"""The memory of a training step: its four kinds, and the one description of a step.

Training memory has four kinds (Rajbhandari et al. 2020, "ZeRO"):

- parameters: the weights, 4 bytes each in float32 (autocast keeps them
  float32 and computes in 16 bits);
- gradients: one number per trained parameter;
- optimizer states: AdamW's two moments per trained parameter (8 bytes in
  float32) and a step counter per parameter tensor;
- saved activations: what the forward pass keeps for the backward pass. They
  grow with batch x sequence length, and for long contexts they dominate.

ZeRO stage 1 shards the optimizer states over the data-parallel ranks, stage 2
also the gradients, stage 3 (FSDP's scheme) also the parameters. Activations
are never sharded by data parallelism: each rank keeps those of its own batch.
DDP shards nothing and adds its gradient buckets: a second copy of the
gradients, unless ``gradient_as_bucket_view=True`` makes the gradients views
of the buckets.

``TrainingSetup`` describes a step besides the model (batch, precision,
optimizer, what trains, checkpointing, sharding, whose kernels), in one
vocabulary for every formula of the package: ``torchbook.memory.gpt`` for the
book's GPT, ``torchbook.memory.step`` and ``torchbook.memory.peak`` for the
transformers models readers fine-tune. ``python -m torchbook.memory`` runs the
calculator (``torchbook.memory.calculator``). Nothing here imports torch: the
calculator answers at once.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes of each precision's autocast dtype (torchbook.device.AUTOCAST_DTYPES, which
# a test compares): written out so that the calculator answers without importing
# torch, which takes seconds.
AUTOCAST_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4  # bytes of a float32: weights, gradients, Adam moments, LayerNorm inputs
INDEX = 8  # bytes of an int64 token id (the input ids, and the targets)
# The vocabulary of a training step, shared by every formula of this package.
# precision: "fp32"; "bf16" and "fp16" autocast over float32 weights (the book's
# TrainConfig.precision); "bf16-pure" bf16 weights, gradients and states;
# "bf16-master" bf16 weights with float32 master weights, gradients and moments.
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure", "bf16-master")
OPTIMIZERS = ("adamw", "adamw-foreach", "sgd", "none")  # adamw: fused; sgd: momentum
OPTIMIZER_STATES = {"adamw": 2, "adamw-foreach": 2, "sgd": 1, "none": 0}  # per weight
TRAINS = ("all", "lora", "frozen")
BASES = ("auto", "nf4")  # the frozen base's storage: the precision's, or 4-bit NF4
CHECKPOINTING = ("none", "selective", "full")  # torchbook.recompute, GPTConfig
# "trainer": the book's Trainer, whose logits are freed once the loss exists;
# "tutorial": logits = model(x) in the loop, alive until the step ends.
LOOPS = ("trainer", "tutorial")
PARALLEL = ("none", "ddp", "zero1", "zero2", "fsdp")  # data parallelism over ranks
# Which of parameters / gradients / optimizer states each scheme divides by the ranks
# (FSDP is ZeRO stage 3's scheme).
SHARDED = {
    "none": (),
    "ddp": (),
    "zero1": ("optimizer_states",),
    "zero2": ("gradients", "optimizer_states"),
    "fsdp": ("parameters", "gradients", "optimizer_states"),
}
KERNELS = ("cuda", "cpu")  # whose operations are counted: dropout masks, attention


@dataclass(frozen=True)
class TrainingSetup:
    """One training step besides the model: batch, precision, what trains, sharding.

    The one description of a step for every formula here: the book's GPT
    (``torchbook.memory.gpt``) and a transformers model
    (``torchbook.memory.step``, ``torchbook.memory.peak``), the calculator's
    flags too. A formula refuses by name the fields it does not count (the
    GPT's trains every weight).
    ``kernels`` says whose operations are counted: CUDA's, for the GPU a run is
    planned on, or the CPU's, which the book measures.
    """

    batch_size: int  # rows per micro-batch, per rank
    seq_len: int  # tokens per row
    precision: str = "fp32"  # one of PRECISIONS
    optimizer: str = "adamw"  # one of OPTIMIZERS
    trains: str = "all"  # one of TRAINS
    base: str = "auto"  # one of BASES: "nf4" stores the frozen base in 4 bits
    lora_rank: int = 8
    lora_targets: tuple[str, ...] = ()  # (): peft's default for the family
    checkpointing: str = "none"  # one of CHECKPOINTING, per block
    loss_chunks: int = 1  # head and loss over this many slices (loss.summed_loss)
    loop: str = "trainer"  # one of LOOPS
    packed: bool = False  # rows of several documents: position and document ids
    parallel: str = "none"  # one of PARALLEL
    ranks: int = 1  # data-parallel ranks
    gradient_as_bucket_view: bool = False  # DDP's option
    reshard_after_forward: bool = True  # FSDP2's option
    kernels: str = "cuda"  # one of KERNELS

    def __post_init__(self) -> None:
        for name, allowed in (
            ("precision", PRECISIONS),
            ("optimizer", OPTIMIZERS),
            ("trains", TRAINS),
            ("base", BASES),
            ("checkpointing", CHECKPOINTING),
            ("loop", LOOPS),
            ("parallel", PARALLEL),
            ("kernels", KERNELS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"TrainingSetup.{name}={getattr(self, name)!r}; "
                    f"expected one of {list(allowed)}"
                )
        for name in ("batch_size", "seq_len", "lora_rank", "loss_chunks", "ranks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TrainingSetup.{name} must be >= 1, got {value!r}")
        for refused, reason in _refusals(self):
            if refused:
                raise ValueError(f"meaningless setup: {reason}")

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len


def _refusals(setup: TrainingSetup) -> list[tuple[bool, str]]:
    """Combinations no run has, each with the reason it is refused."""
    lora, frozen = setup.trains == "lora", setup.trains == "frozen"
    return [
        (
            setup.parallel == "none" and setup.ranks > 1,
            f"ranks={setup.ranks} with parallel='none': choose {PARALLEL[1:]}",
        ),
        (
            setup.gradient_as_bucket_view and setup.parallel != "ddp",
            "gradient_as_bucket_view is DDP's",
        ),
        (
            not setup.reshard_after_forward and setup.parallel != "fsdp",
            "reshard_after_forward is FSDP2's",
        ),
        (setup.loss_chunks > setup.seq_len, "loss_chunks > seq_len"),
        (
            setup.loss_chunks > 1 and setup.loop == "tutorial",
            "the tutorial loop has no chunked loss",
        ),
        (
            setup.loss_chunks > 1 and setup.parallel == "fsdp",
            "FSDP2 gathers the head in the root's forward, which a chunked loss "
            "runs outside",
        ),
        (
            frozen and (setup.optimizer, setup.checkpointing) != ("none", "none"),
            "a frozen model has no optimizer and no backward to checkpoint "
            "(optimizer='none', checkpointing='none')",
        ),
        (frozen and setup.parallel != "none", "a frozen model is not trained"),
        (not lora and setup.lora_targets, "lora_targets without trains='lora'"),
        (
            lora and setup.precision == "bf16-master",
            "peft keeps LoRA adapters in float32: they are their own master copy; "
            "use bf16-pure",
        ),
        (
            setup.precision == "bf16-master" and setup.optimizer == "none",
            "bf16-master keeps its float32 copy for an optimizer",
        ),
        (
            setup.base == "nf4" and not lora,
            "base='nf4' is QLoRA's frozen base: it needs trains='lora'",
        ),
        (
            setup.base == "nf4" and setup.precision in ("fp16", "bf16-master"),
            f"base='nf4' is counted with fp32, bf16 or bf16-pure, not "
            f"{setup.precision}",
        ),
        (
            setup.base == "nf4" and setup.parallel == "fsdp",
            "FSDP2 does not shard bitsandbytes' 4-bit weights",
        ),
    ]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank of each kind of training memory."""

    parameters: int
    gradients: int
    optimizer_states: int
    gradient_buckets: int  # DDP's
    activations: int

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer_states
            + self.gradient_buckets
            + self.activations
        )
