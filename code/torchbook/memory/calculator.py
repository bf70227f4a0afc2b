"""The memory calculator: ``python -m torchbook.memory --config config.json``.

A reader's question is "does my fine-tuning run fit?". ``main`` reads a
Hugging Face ``config.json`` (``torchbook.memory.configs``; without one, the
book's GPT, counted by ``torchbook.memory``), flags for the step (batch per
micro-batch, sequence, precision, optimizer, what trains, checkpointing, a
chunked loss, data parallelism), and prints each kind of memory per rank in
bytes and GB, the peak of the step (``torchbook.memory.peak``), whether it
fits a GPU, what no prediction here counts, and the assumptions in words; or
``--json``. Meaningless combinations (``--ranks 8`` without a ``--parallel``)
are refused by name. It builds on ``torchbook.memory``,
``torchbook.memory.configs``, ``torchbook.memory.step`` and
``torchbook.memory.peak``; it imports no torch, so it answers at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from torchbook.memory import (
    TrainingShape,
    loss_backward_bytes,
    predict_memory,
    predict_peak,
)
from torchbook.memory import activation_terms as gpt_activation_terms
from torchbook.memory.configs import (
    OVERRIDES,
    Architecture,
    architecture,
    read_config,
    with_overrides,
)
from torchbook.memory.peak import predict
from torchbook.memory.step import (
    CHECKPOINTING,
    DEVICES,
    OPTIMIZERS,
    PARALLEL,
    PRECISIONS,
    TRAINS,
    Setup,
    trainable,
)

# the book's GPT when no --config is given: GPT-2 small's shape
BOOK_GPT_DEFAULTS = {"vocab_size": 50304, "n_layer": 12, "n_head": 12, "d_model": 768}

GPU_GB = 80.0  # the GPUs readers rent: A100 / H100 with 80 GB
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
    "bf16-autocast": "float32 weights, gradients and AdamW moments; bf16 autocast",
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


def book_gpt_rows(arch: Architecture, setup: Setup, loop: str) -> tuple[dict, int]:
    """Rows and peak of the book's GPT, by ``torchbook.memory``'s formula."""
    unsupported = [
        (
            setup.precision in ("bf16-pure", "bf16-master"),
            f"--precision {setup.precision}",
        ),
        (
            setup.optimizer in ("adamw-foreach", "none"),
            f"--optimizer {setup.optimizer}",
        ),
        (setup.trains != "all", f"--trains {setup.trains}"),
        (not setup.reshard_after_forward, "--no-reshard-after-forward"),
    ]
    for refused, flag in unsupported:
        if refused:
            raise ValueError(
                f"{flag}: the book's GPT formula models full training of float32 "
                "weights with fused AdamW or SGD; give --config for a transformers "
                "model to predict it"
            )
    config = BookGPT(
        arch.vocab_size,
        setup.seq_len,
        arch.layers,
        arch.heads,
        arch.hidden_size,
        arch.residual_dropout,
    )
    shape = TrainingShape(
        setup.batch_size,
        setup.seq_len,
        "bf16" if setup.precision == "bf16-autocast" else "fp32",
        setup.checkpointing,
        setup.loss_chunks,
        loop,
        setup.optimizer,
        setup.parallel,
        setup.ranks,
        setup.bucket_view,
        device_type=setup.device_type,
    )
    rows = memory_rows(
        predict_memory(config, shape), gpt_activation_terms(config, shape)
    )
    rows["logits' share at the loss's backward"] = loss_backward_bytes(config, shape)
    return rows, predict_peak(config, shape)


def memory_rows(memory: Any, activations: dict[str, int]) -> dict[str, int]:
    """The report's rows: the four kinds of state, then the activations by source.

    ``memory`` is either prediction (the book's GPT's or a Hugging Face model's):
    both name the four kinds the same way.
    """
    rows = {
        "parameters": memory.parameters,
        "gradients": memory.gradients,
        "optimizer states": memory.optimizer_states,
        "DDP gradient buckets": memory.gradient_buckets,
    }
    for term, value in activations.items():
        rows[f"activations: {term}"] = value
    return rows


def assumptions(
    arch: Architecture, setup: Setup, config: str, loop: str, book_llama: bool
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
    if setup.parallel == "fsdp" and not setup.reshard_after_forward:
        lines.append("reshard_after_forward=False: every block stays gathered")
    if book:
        lines.append(f"the {loop} loop (torchbook.memory)")
    kernel = (
        "the CPU's kernels, as torchbook.memory.check runs them"
        if setup.device_type == "cpu"
        else "CUDA's fused SDPA kernels: formula only, unmeasured on a GPU"
    )
    lines.append(f"attention: {kernel}")
    if arch.attention_dropout > 0 and setup.device_type == "cpu":
        lines.append("attention dropout: the CPU's math path, three (T, T) per head")
    checked = setup.device_type == "cpu" and setup.parallel in ("none", "fsdp")
    if not book:
        lines.append(
            "checked by a fake-tensor run of this setup (torchbook.memory.check)"
            if checked
            else "not run by torchbook.memory.check: formula only"
        )
    return lines


def report(
    title: str, rows: dict[str, int], peak: int, moment: str, gpu_gb: float
) -> dict[str, object]:
    """Everything the calculator prints, as data (``--json`` prints it as is)."""
    gpu = int(gpu_gb * 1e9)
    return {
        "model": title,
        "bytes": rows,
        "peak_bytes": peak,
        "peak_moment": moment,
        "gpu_bytes": gpu,
        "fits": peak <= gpu,
        "not_counted": list(NOT_COUNTED),
    }


def table(result: dict[str, object], notes: list[str]) -> str:
    """The report as lines: assumptions, rows in bytes and GB, the fit last."""
    lines = [str(result["model"]), "assumptions:"]
    lines += [f"  - {note}" for note in notes]
    lines.append(f"{'':44s}{'bytes':>18s}{'GB':>10s}")
    peak, gpu = result["peak_bytes"], result["gpu_bytes"]
    rows = {**result["bytes"], f"peak ({result['peak_moment']})": peak}
    for name, value in rows.items():
        lines.append(f"{name:44s}{value:>18,}{value / 1e9:>10.3f}")
    lines.append("not counted: " + "; ".join(result["not_counted"]))
    if result["fits"]:
        verdict = f"yes, {(gpu - peak) / 1e9:.1f} GB left for what is not counted"
    else:
        verdict = f"no, {(peak - gpu) / 1e9:.1f} GB over"
    lines.append(f"fits in {gpu / 1e9:g} GB ({peak / gpu:.0%} of it): {verdict}")
    return "\n".join(lines)


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
        model.add_argument(flag, type=int, help=f"{meaning} (default: the config's)")
    step = parser.add_argument_group("the step")

    def add(
        flag: str, default: object, meaning: str, shown: object = None, **kwargs: object
    ) -> None:
        shown = default if shown is None else shown
        step.add_argument(
            flag, default=default, help=f"{meaning} (default: {shown})", **kwargs
        )

    add("--batch", 8, "rows per micro-batch, per rank", type=int)
    add("--seq", 1024, "tokens per row", type=int)
    choices = {
        "--precision": (
            PRECISIONS,
            "float32 weights under bf16 autocast, all float32, pure bf16, or bf16 "
            "with float32 master weights",
        ),
        "--optimizer": (OPTIMIZERS, "adamw is fused; foreach is PyTorch's on CUDA"),
        "--trains": (TRAINS, "every parameter, LoRA adapters, or nothing"),
        "--checkpointing": (
            CHECKPOINTING,
            "per block; selective keeps the matmuls' and attention's outputs",
        ),
        "--parallel": (PARALLEL, "data parallelism over --ranks"),
        "--loop": (
            ("trainer", "tutorial"),
            "the book's GPT only: the tutorial version keeps the logits",
        ),
        "--kernels": (
            DEVICES,
            "CUDA's operations (formula only) or the CPU's, which "
            "torchbook.memory.check runs",
        ),
    }
    for flag, (allowed, meaning) in choices.items():
        add(flag, allowed[0], meaning, choices=allowed)
    add("--lora-rank", None, "with --trains lora", 8, type=int)
    add("--lora-targets", None, "comma-separated projections", "peft's", type=str)
    add("--loss-chunks", 1, "slices of the head and loss", type=int)
    add("--ranks", 1, "data-parallel ranks", type=int)
    add("--gpu-gb", GPU_GB, "GPU memory in GB", type=float)
    step.add_argument(
        "--bucket-view", action="store_true", help="DDP's gradient_as_bucket_view"
    )
    step.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="FSDP2's reshard_after_forward=False",
    )
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    return parser


def calculate(args: argparse.Namespace) -> tuple[dict[str, object], list[str]]:
    """The report for parsed flags; ``ValueError`` names what is wrong."""
    if args.gpu_gb <= 0:
        raise ValueError(f"--gpu-gb must be > 0, got {args.gpu_gb}")
    if args.config:
        config, source = read_config(args.config), args.config
    else:
        config, source = dict(BOOK_GPT_DEFAULTS, block_size=args.seq), "the book's GPT"
    overrides = {name: getattr(args, name) for name in OVERRIDES}
    arch = architecture(with_overrides(config, overrides), source)
    book = arch.family == "torchbook-gpt"
    if book and args.seq > config.get("block_size", args.seq):
        raise ValueError(f"--seq {args.seq} is past the config's block_size")
    if not book and args.loop != "trainer":
        raise ValueError("--loop tutorial is the book's GPT's (torchbook.memory)")
    if args.lora_rank is not None and args.trains != "lora":
        raise ValueError("--lora-rank needs --trains lora")
    targets = tuple(args.lora_targets.split(",")) if args.lora_targets else ()
    setup = Setup(
        args.batch,
        args.seq,
        args.precision,
        args.optimizer,
        args.trains,
        args.lora_rank or 8,
        targets,
        args.checkpointing,
        args.loss_chunks,
        args.parallel,
        args.ranks,
        args.bucket_view,
        not args.no_reshard_after_forward,
        args.kernels,
    )
    if book:
        rows, peak = book_gpt_rows(arch, setup, args.loop)
        moment = "torchbook.memory.predict_peak"
    else:
        prediction = predict(arch, setup)
        rows = memory_rows(prediction, prediction.activations)
        peak, moment = prediction.peak, prediction.peak_moment
    count, _ = trainable(arch, setup) if not book else (arch.parameter_count(), 0)
    title = (
        f"{source} ({arch.family}): {arch.parameter_count():,} parameters, "
        f"{count:,} training"
    )
    result = report(title, rows, peak, moment, args.gpu_gb)
    book_llama = "n_kv_head" in config
    return result, assumptions(arch, setup, source, args.loop, book_llama)


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, print the report (a table, or ``--json``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result, notes = calculate(args)
    except ValueError as error:  # names the flag or field and what was expected
        parser.error(str(error))
    if args.json:
        print(json.dumps({**result, "assumptions": notes}, indent=2))
    else:
        print(table(result, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
