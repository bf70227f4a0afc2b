"""The memory calculator: ``python -m torchbook.memory --config config.json``.

A reader's question is "does my fine-tuning run fit?". ``main`` reads a
Hugging Face ``config.json`` (``torchbook.memory.configs``; without one, the
book's GPT, counted by ``torchbook.memory.gpt``), flags for the step (batch
per micro-batch, sequence, precision, optimizer, what trains, the base's
storage, checkpointing, a chunked loss, data parallelism), and prints each
kind of memory per rank in bytes and GiB, the peak of the step
(``torchbook.memory.peak``), whether it fits a GPU (``torchbook.memory.fit``),
what no prediction here counts, and the assumptions in words; or ``--json``
for scripts, with every count an integer. A bad file, field or combination
of flags ends in one message that names it, and exit status 2. It builds on
``torchbook.memory.configs``, ``torchbook.memory.gpt``,
``torchbook.memory.step``, ``torchbook.memory.peak`` and
``torchbook.memory.fit``; it imports no torch, so it answers at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from torchbook.memory import (
    BASES,
    CHECKPOINTING,
    KERNELS,
    LOOPS,
    OPTIMIZERS,
    PARALLEL,
    PRECISIONS,
    TRAINS,
    TrainingSetup,
)
from torchbook.memory.configs import (
    OVERRIDES,
    Architecture,
    architecture,
    read_config_json,
    with_overrides,
)
from torchbook.memory.fit import FIT_SHARE, GIB, GPU_GIB, fits, usable_bytes
from torchbook.memory.gpt import (
    activation_terms,
    loss_backward_bytes,
    predict_memory,
    predict_peak,
)
from torchbook.memory.peak import predict
from torchbook.memory.step import parameter_bytes, trainable

# the book's GPT when no --config is given: GPT-2 small's shape
BOOK_GPT_DEFAULTS = {"vocab_size": 50304, "n_layer": 12, "n_head": 12, "d_model": 768}
# What no prediction here counts, with a size where a source gives one.
NOT_COUNTED = (
    "the CUDA context (unmeasured)",
    # cuBLAS documentation, cublasSetWorkspace: the recommended workspace
    # https://docs.nvidia.com/cuda/cublas/index.html#cublassetworkspace
    "cuBLAS's workspace (32 MiB per stream on Hopper, 4 MiB on other GPUs, as "
    "cuBLAS recommends)",
    "NCCL's communication buffers (unmeasured)",
    "the caching allocator's cached and fragmented blocks (unmeasured)",
    "kernels' scratch memory that no operation returns (unmeasured)",
)
PRECISION_WORDS = {
    "bf16": "float32 weights, gradients and AdamW moments; bf16 autocast",
    "fp16": "float32 weights, gradients and AdamW moments; fp16 autocast",
    "fp32": "float32 weights, gradients, moments and compute",
    "bf16-pure": "bf16 weights, gradients and optimizer moments; no autocast",
    "bf16-master": "bf16 weights for compute; float32 master weights, gradients "
    "and moments (FSDP2: MixedPrecisionPolicy(param_dtype=bfloat16, "
    "reduce_dtype=float32) over float32 shards)",
}
OPTIMIZER_WORDS = {
    "adamw": "fused AdamW: two moments and a step counter per tensor",
    "adamw-foreach": "foreach AdamW (PyTorch's default on CUDA): fused's states, "
    "and at the step a list the size of the parameters",
    "sgd": "SGD with momentum: one buffer per parameter",
    "none": "no optimizer step: forward and backward only",
}
PARALLEL_WORDS = {
    "none": "one process",
    "ddp": "DDP: its buckets hold a second copy of the gradients",
    "zero1": "ZeRO-1: optimizer states sharded (formula only)",
    "zero2": "ZeRO-2: optimizer states and gradients sharded; buckets in "
    "flight not counted (formula only)",
    "fsdp": "FSDP2: fully_shard on each decoder layer and on the root",
}
NF4_WORDS = (
    "the frozen base's projections in 4-bit NF4 as bitsandbytes stores them "
    "(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
    "bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)); "
    "embeddings, norms and lm_head in the model's dtype, as transformers "
    "leaves them (no prepare_model_for_kbit_training)"
)


@dataclass(frozen=True)
class BookGPT:
    """The fields of ``torchbook.models.GPTConfig`` the formula reads, without torch."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    d_model: int
    dropout: float = 0.0

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_head


def book_gpt_rows(arch: Architecture, setup: TrainingSetup) -> tuple[dict, int]:
    """Rows and peak of the book's GPT, by ``torchbook.memory.gpt``'s formula."""
    config = BookGPT(
        arch.vocab_size,
        setup.seq_len,
        arch.layers,
        arch.heads,
        arch.hidden_size,
        arch.residual_dropout,
    )
    rows = memory_rows(
        predict_memory(config, setup), activation_terms(config, setup), {}
    )
    rows["logits' share at the loss's backward"] = loss_backward_bytes(config, setup)
    return rows, predict_peak(config, setup)


def memory_rows(
    memory: Any, activations: dict[str, int], parameters: dict[str, int]
) -> dict[str, int]:
    """The report's rows: the four kinds of state, then the activations by source.

    ``memory`` is either prediction (the book's GPT's or a Hugging Face model's):
    both name the four kinds the same way. ``parameters`` splits the parameters'
    bytes by storage, where there is more than one.
    """
    rows = {"parameters": memory.parameters}
    if len([value for value in parameters.values() if value]) > 1:
        for storage, value in parameters.items():
            rows[f"parameters: {storage}"] = value
    rows["gradients"] = memory.gradients
    rows["optimizer states"] = memory.optimizer_states
    rows["DDP gradient buckets"] = memory.gradient_buckets
    for term, value in activations.items():
        rows[f"activations: {term}"] = value
    return rows


def assumptions(
    arch: Architecture, setup: TrainingSetup, config: str, book_llama: bool
) -> list[str]:
    """What the prediction assumes, in words: the model, the step, the kernels."""
    book = arch.family == "torchbook-gpt"
    hf = f"transformers' {arch.family} model, SDPA attention, use_cache=False"
    model = f"{hf}, from {config}"
    if book:
        model = "the book's GPT (torchbook.models)"
    elif book_llama:  # the same matrices; activations as transformers' code saves them
        model = f"the book's Llama (torchbook.llama) from {config}, counted as {hf}"
    loss = "the loss over the whole sequence at once"
    if setup.loss_chunks > 1:
        loss = f"the head and loss over {setup.loss_chunks} checkpointed slices"
    lines = [
        model,
        f"{setup.batch_size} row{'s' * (setup.batch_size > 1)} of {setup.seq_len} "
        "tokens per micro-batch, per rank; "
        "one micro-batch per step (with accumulation, earlier micro-batches' "
        "gradients are there too)",
        PRECISION_WORDS[setup.precision],
        OPTIMIZER_WORDS[setup.optimizer],
        {
            "all": "every parameter trains",
            "lora": f"LoRA of rank {setup.lora_rank} on "
            f"{', '.join(setup.lora_targets) or 'peft default targets'}, "
            "adapters in float32 as peft makes them; the base frozen",
            "frozen": "nothing trains: a forward without gradients",
        }[setup.trains],
        f"activation checkpointing: {setup.checkpointing} (per block)",
        loss,
        PARALLEL_WORDS[setup.parallel]
        + (f" over {setup.ranks} ranks" if setup.parallel != "none" else ""),
    ]
    if setup.base == "nf4":
        lines.append(NF4_WORDS)
        lines.append(
            "checked against a measured CPU step (torchbook.memory.qlora_step)"
            if setup.checkpointing == "none" and setup.kernels == "cpu"
            else "4-bit base: checked on the CPU without checkpointing only; "
            "this setup is formula only"
        )
    if setup.parallel == "fsdp" and not setup.reshard_after_forward:
        lines.append("reshard_after_forward=False: every block stays gathered")
    if book:
        lines.append(f"the {setup.loop} loop (torchbook.memory.gpt)")
    kernel = (
        "the CPU's kernels, as torchbook.memory.check runs them"
        if setup.kernels == "cpu"
        else "CUDA's fused SDPA kernels: formula only, unmeasured on a GPU"
    )
    lines.append(f"attention: {kernel}")
    if arch.attention_dropout > 0 and setup.kernels == "cpu":
        lines.append("attention dropout: the CPU's math path, three (T, T) per head")
    checked = setup.kernels == "cpu" and setup.parallel in ("none", "fsdp")
    if not book and setup.base != "nf4":
        lines.append(
            "checked by a fake-tensor run of this setup (torchbook.memory.check)"
            if checked
            else "not run by torchbook.memory.check: formula only"
        )
    return lines


def report(
    arch: Architecture,
    setup: TrainingSetup,
    rows: dict[str, int],
    peak: tuple[int, str],
    gpu_gib: float,
) -> dict[str, object]:
    """Everything the calculator prints, as data (``--json`` prints it as is).

    Every count is an integer: parameters, bytes per kind and per source of
    activations, the peak, and the bytes of the card a run may use.
    """
    count = arch.parameter_count()
    trained = trainable(arch, setup)[0] if arch.family != "torchbook-gpt" else count
    kinds = {
        "parameters": rows["parameters"],
        "gradients": rows["gradients"],
        "optimizer_states": rows["optimizer states"],
        "gradient_buckets": rows["DDP gradient buckets"],
    }
    activations = {
        name.removeprefix("activations: "): value
        for name, value in rows.items()
        if name.startswith("activations: ")
    }
    kinds["activations"] = sum(activations.values())
    return {
        "model": arch.family,
        "parameters": count,
        "trainable_parameters": trained,
        "bytes": kinds,
        "parameter_bytes": {
            name.removeprefix("parameters: "): value
            for name, value in rows.items()
            if name.startswith("parameters: ")
        },
        "activations": activations,
        "rows": rows,
        "peak_bytes": peak[0],
        "peak_instant": peak[1],
        "gpu_gib": gpu_gib,
        "usable_bytes": usable_bytes(gpu_gib),
        "fits": fits(peak[0], gpu_gib),
        "not_counted": list(NOT_COUNTED),
    }


def table(result: dict[str, Any], title: str, notes: list[str]) -> str:
    """The report as lines: assumptions, rows in bytes and GiB, the fit last."""
    lines = [title, "assumptions:"]
    lines += [f"  - {note}" for note in notes]
    lines.append(f"{'':44s}{'bytes':>18s}{'GiB':>10s}")
    peak, gpu = result["peak_bytes"], result["gpu_gib"]
    rows = {**result["rows"], f"peak ({result['peak_instant']})": peak}
    for name, value in rows.items():
        lines.append(f"{name:44s}{value:>18,}{value / GIB:>10.3f}")
    lines.append("not counted: " + "; ".join(result["not_counted"]))
    share = f"{peak / (gpu * GIB):.0%} of the card"
    verdict = "yes" if result["fits"] else "no"
    lines.append(
        f"fits a {gpu:g} GiB GPU, whose first {FIT_SHARE:.0%} "
        f"({result['usable_bytes'] / GIB:.1f} GiB) a run may use: {verdict}, "
        f"the peak is {peak / GIB:.1f} GiB, {share}"
    )
    return "\n".join(lines)


def _positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The calculator's flags, each with its default in ``--help``."""
    parser = argparse.ArgumentParser(
        prog="python -m torchbook.memory",
        description="Predict a training step's memory per rank, by kind, and its "
        "peak, for a Hugging Face config.json or the book's GPT.",
    )
    model = parser.add_argument_group("the model")
    model.add_argument(
        "--config",
        help="a config.json: model_type llama, mistral, qwen2 or gpt2, or the book's "
        "GPTConfig or LlamaConfig fields (default: the book's GPT, 12 x 768)",
    )
    for flag, meaning in (
        ("--layers", "blocks"),
        ("--width", "hidden size"),
        ("--heads", "query heads"),
        ("--kv-heads", "key/value heads"),
        ("--ffn", "MLP hidden size"),
        ("--vocab", "vocabulary"),
    ):
        model.add_argument(
            flag, type=_positive, help=f"{meaning} (default: the config's)"
        )
    step = parser.add_argument_group("the step")

    def add(
        flag: str, default: object, meaning: str, shown: object = None, **kwargs: object
    ) -> None:
        shown = default if shown is None else shown
        step.add_argument(
            flag, default=default, help=f"{meaning} (default: {shown})", **kwargs
        )

    add("--batch", 8, "rows per micro-batch, per rank", type=_positive)
    add("--seq", 1024, "tokens per row", type=_positive)
    choices = {
        "--precision": (
            PRECISIONS,
            "float32 weights, or under bf16 or fp16 autocast; pure bf16; or bf16 "
            "with float32 master weights",
            "bf16",
        ),
        "--optimizer": (OPTIMIZERS, "adamw is fused; foreach is PyTorch's on CUDA"),
        "--trains": (TRAINS, "every parameter, LoRA adapters, or nothing"),
        "--base": (
            BASES,
            "the frozen base's storage: the precision's, or QLoRA's 4-bit NF4 "
            "(with --trains lora)",
        ),
        "--checkpointing": (
            CHECKPOINTING,
            "per block; selective keeps the matmuls' and attention's outputs",
        ),
        "--parallel": (PARALLEL, "data parallelism over --ranks"),
        "--loop": (LOOPS, "the book's GPT only: the tutorial version keeps logits"),
        "--kernels": (
            KERNELS,
            "CUDA's operations (formula only) or the CPU's, which "
            "torchbook.memory.check runs",
        ),
    }
    for flag, (allowed, meaning, *default) in choices.items():
        add(flag, default[0] if default else allowed[0], meaning, choices=allowed)
    add("--lora-rank", None, "with --trains lora", 8, type=_positive)
    add("--lora-targets", None, "comma-separated projections", "peft's", type=str)
    add("--loss-chunks", 1, "slices of the head and loss", type=_positive)
    add("--ranks", 1, "data-parallel ranks", type=_positive)
    add("--gpu-gib", GPU_GIB, "the GPU's memory in GiB", type=float)
    for flag, meaning in (
        ("--gradient-as-bucket-view", "DDP's gradient_as_bucket_view=True"),
        ("--no-reshard-after-forward", "FSDP2's reshard_after_forward=False"),
    ):
        step.add_argument(flag, action="store_true", help=meaning)
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    return parser


def calculate(args: argparse.Namespace) -> tuple[dict[str, Any], str, list[str]]:
    """The report, its title and its assumptions; ``ValueError`` names what is wrong."""
    if not args.gpu_gib > 0:
        raise ValueError(f"--gpu-gib must be > 0, got {args.gpu_gib}")
    if args.config:
        config, source = read_config_json(args.config), args.config
    else:
        config, source = dict(BOOK_GPT_DEFAULTS, block_size=args.seq), "the book's GPT"
    overrides = {name: getattr(args, name) for name in OVERRIDES}
    arch = architecture(with_overrides(config, overrides, source), source)
    book = arch.family == "torchbook-gpt"
    if book and args.seq > config.get("block_size", args.seq):
        raise ValueError(f"--seq {args.seq} is past the config's block_size")
    if args.lora_rank is not None and args.trains != "lora":
        raise ValueError("--lora-rank needs --trains lora")
    targets = tuple(args.lora_targets.split(",")) if args.lora_targets else ()
    setup = TrainingSetup(
        args.batch,
        args.seq,
        precision=args.precision,
        optimizer=args.optimizer,
        trains=args.trains,
        base=args.base,
        lora_rank=args.lora_rank or 8,
        lora_targets=targets,
        checkpointing=args.checkpointing,
        loss_chunks=args.loss_chunks,
        loop=args.loop,
        parallel=args.parallel,
        ranks=args.ranks,
        gradient_as_bucket_view=args.gradient_as_bucket_view,
        reshard_after_forward=not args.no_reshard_after_forward,
        kernels=args.kernels,
    )
    if book:
        rows, peak = book_gpt_rows(arch, setup)
        instant = "torchbook.memory.gpt.predict_peak"
    else:
        prediction = predict(arch, setup)
        stored = parameter_bytes(arch, setup)
        rows = memory_rows(prediction, prediction.activations, stored)
        peak, instant = prediction.peak, prediction.peak_instant
    result = report(arch, setup, rows, (peak, instant), args.gpu_gib)
    title = (
        f"{source} ({arch.family}): {result['parameters']:,} parameters, "
        f"{result['trainable_parameters']:,} training"
    )
    book_llama = "n_kv_head" in config
    return result, title, assumptions(arch, setup, source, book_llama)


def json_report(result: dict[str, Any], title: str, notes: list[str]) -> dict:
    """What ``--json`` prints: the named keys scripts read, without the table's rows."""
    data = {key: value for key, value in result.items() if key != "rows"}
    return {"title": title, **data, "assumptions": notes}


def estimate(argv: list[str]) -> dict[str, Any]:
    """The ``--json`` report for these flags, as a dict: for scripts and notebooks.

    Nothing is printed; a bad file, field or combination raises ``ValueError``.
    """
    return json_report(*calculate(build_parser().parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, print the report (a table, or ``--json``).

    A bad file, field or combination ends in one message and exit status 2.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result, title, notes = calculate(args)
    except ValueError as error:  # names the file, field or flag, and what was expected
        parser.error(str(error))
    if args.json:
        print(json.dumps(json_report(result, title, notes), indent=2))
    else:
        print(table(result, title, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
