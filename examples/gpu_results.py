"""Rebuild every full-size result the book shows as JSON files with provenance.

Run on a GPU machine with the gpu profile (``QUARTO_PROFILE=gpu``, what ``make
gpu-results`` sets), it trains chapter 3's language model at full size in
bf16, runs the lab's drills, times ``torch.compile`` on chapter 3's model and
measures chapter 7's GPT-2-sized model (tokens per second, MFU, peak memory),
and writes one file per run, ``<run>-<profile>.json``, into ``--out``
(``assets/results/``). With the cpu profile it writes the same files from the
small sizes; ``--max-steps`` shortens the language-model run further.

``--dry-run`` (``make gpu-results DRY_RUN=1``) needs no GPU and computes
nothing at full size: it runs each run's training step at the gpu profile's
sizes and precision on fake tensors (``torchbook.dry_run``), which meets every
shape, config and autocast cast, prints the step's peak memory as tracked
beside the book's formula for it, and writes those numbers in the results
format, as ``<run>-gpu-dry-run.json`` files marked ``dry_run``, which the
chapters never read.

Each file records the hashes of the sources it depends on; the appendix lists
the files with the device and date each was made on, and whether its code has
changed since.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from torchbook.charlm import (
    build,
    load_corpus,
    random_blocks,
    train_char_lm,
    unigram_baseline,
)
from torchbook.device import AUTOCAST_DTYPES, timed
from torchbook.download import repository_root, shakespeare_path
from torchbook.dry_run import FAKE_DEVICE, fake_peak_bytes, gpu_steps
from torchbook.flops import matmul_flops_per_second, throughput_metrics
from torchbook.lab import load_data, run_drills
from torchbook.memory import TrainingShape, predict_peak
from torchbook.memory_measure import peak_bytes, state_bytes, training_step
from torchbook.models import GPT, GPTConfig
from torchbook.profiles import (
    LabSizes,
    LanguageModelSizes,
    MemorySizes,
    Profile,
    active_profile,
    gpu_profile,
)
from torchbook.results import history_series, make_provenance, write_result


class Output(NamedTuple):
    """Where a run writes its file, and whether the file is a dry run's."""

    folder: Path
    dry_run: bool = False

    def path(self, run: str, profile: Profile) -> Path:
        return (
            self.folder
            / f"{run}-{profile.name}{'-dry-run' if self.dry_run else ''}.json"
        )

    def write(
        self, run: str, profile: Profile, metrics: dict, history: dict, provenance: dict
    ) -> Path:
        return write_result(
            self.path(run, profile),
            run,
            profile.name,
            metrics,
            history,
            provenance,
            dry_run=self.dry_run,
        )


# What each run's numbers depend on: a change to any of these makes its file stale.
LM_SOURCES = (
    "code/torchbook/charlm.py",
    "code/torchbook/models.py",
    "code/torchbook/train.py",
    "code/torchbook/profiles.py",
    "examples/gpu_results.py",
)


def shorter(sizes: LanguageModelSizes, max_steps: int) -> LanguageModelSizes:
    """``sizes`` cut to ``max_steps`` optimizer steps, warmup and logging included."""
    return dataclasses.replace(
        sizes,
        max_steps=max_steps,
        warmup_steps=min(sizes.warmup_steps, max_steps),
        eval_every=min(sizes.eval_every, max_steps),
        log_every=min(sizes.log_every, max_steps),
    )


def run_language_model(
    out: Output, profile: Profile, sizes: LanguageModelSizes
) -> Path:
    """Chapter 3's character-level GPT at ``sizes``; returns the results file."""
    corpus = load_corpus(shakespeare_path())
    started = time.perf_counter()
    run = train_char_lm(corpus, sizes, profile.device, profile.precision, profile.seed)
    history = run.trainer.history
    series = history_series(history)
    parameters = sum(p.numel() for p in run.trainer.model.parameters())
    metrics = {
        "parameters": parameters,
        "steps": run.trainer.step,
        "train_seconds": run.train_seconds,
        "final_train_loss": history[-1]["loss"],
        "final_val_loss": series["val"]["loss"][-1],
        "unigram_baseline": unigram_baseline(corpus),
        "tokens_per_second": history[-1]["tokens_per_second"],
    }
    provenance = make_provenance(
        profile.device, repository_root(), LM_SOURCES, time.perf_counter() - started
    )
    path = out.write("lm", profile, metrics, series, provenance)
    print(
        f"lm: {run.trainer.step} steps in {run.train_seconds:.1f} s, validation loss "
        f"{metrics['final_val_loss']:.3f} nats/char -> {path}",
        flush=True,
    )
    return path


RUNS = ("lm", "lab", "compile", "memory")


COMPILE_SOURCES = (
    "code/torchbook/charlm.py",
    "code/torchbook/models.py",
    "code/torchbook/train.py",
    "code/torchbook/profiles.py",
    "examples/gpu_results.py",
)
COMPILE_WARMUP_STEPS = 3  # after the first step: the allocator and caches settle
# steady steps timed per model, eager and compiled taking turns
COMPILE_TIMED_STEPS = 30


def run_compile(
    out: Output,
    profile: Profile,
    sizes: LanguageModelSizes,
    warmup_steps: int = COMPILE_WARMUP_STEPS,
    timed_steps: int = COMPILE_TIMED_STEPS,
) -> Path:
    """Chapter 3's GPT at ``sizes``, eager vs ``torch.compile``: first and steady step.

    The first compiled step runs with the compiler's caches off, so its
    compilation time is a cold start's.
    """
    corpus = load_corpus(shakespeare_path())
    batch = [
        next(
            random_blocks(
                corpus.train_tokens,
                sizes.block_size,
                sizes.batch_size,
                torch.Generator().manual_seed(profile.seed),
            )
        )
    ]
    trainers = {
        name: build(corpus, sizes, profile.device, profile.precision, profile.seed)
        for name in ("eager", "compiled")
    }
    trainers["compiled"].model = torch.compile(trainers["compiled"].model)

    def timed_step(name: str) -> float:
        return timed(lambda: trainers[name].train_step(batch), profile.device)[1]

    started = time.perf_counter()
    # The compiled one includes compilation, with the caches off: it compiles from
    # nothing, as in a fresh environment, whatever an earlier run left on disk.
    with torch.compiler.config.patch(force_disable_caches=True):
        first = {name: timed_step(name) for name in trainers}
    for _ in range(warmup_steps):
        for name in trainers:
            timed_step(name)
    steps = {name: [] for name in trainers}
    for _ in range(timed_steps):  # alternate, so a change in load hits both alike
        for name in trainers:
            steps[name].append(timed_step(name))
    step = {name: statistics.median(times) for name, times in steps.items()}
    metrics = {
        "eager_first_step_s": first["eager"],
        "compiled_first_step_s": first["compiled"],
        "eager_step_s": step["eager"],
        "compiled_step_s": step["compiled"],
        "speedup": step["eager"] / step["compiled"],
        "compile_s": first["compiled"] - step["compiled"],
        "compile_caches_off": 1.0,  # the compile_s of a cold start
        "tokens_per_step": sizes.block_size * sizes.batch_size,
    }
    history = {
        name: {"step": [float(i + 1) for i in range(timed_steps)], "seconds": times}
        for name, times in steps.items()
    }
    provenance = make_provenance(
        profile.device,
        repository_root(),
        COMPILE_SOURCES,
        time.perf_counter() - started,
    )
    path = out.write("compile", profile, metrics, history, provenance)
    print(
        f"compile: {metrics['speedup']:.2f}x steady-state, compilation {metrics['compile_s']:.1f} s -> {path}",
        flush=True,
    )
    return path


# ----- the lab: chapter 9's seven drills at the profile's sizes -----

LAB_SOURCES = (
    "code/torchbook/lab.py",
    "code/torchbook/mnist.py",
    "code/torchbook/optim.py",
    "code/torchbook/profiles.py",
    "examples/gpu_results.py",
)


def run_lab(out: Output, profile: Profile, sizes: LabSizes) -> Path:
    """The seven drills at ``sizes``; numbers, histories to ``lab-<profile>.json``."""
    started = time.perf_counter()
    data = load_data(profile.device)
    metrics, series = run_drills(data, sizes, profile)
    provenance = make_provenance(
        profile.device, repository_root(), LAB_SOURCES, time.perf_counter() - started
    )
    path = out.write("lab", profile, metrics, series, provenance)
    print(
        f"lab: {metrics['drill1.accuracy']:.2%} after {sizes.epochs} epochs, compile speedup "
        f"{metrics['drill2.speedup']:.2f}x -> {path}",
        flush=True,
    )
    return path


# ----- chapter 7: memory, throughput and MFU of a GPT-2-sized model -----

MEMORY_SOURCES = (
    "code/torchbook/memory.py",
    "code/torchbook/memory_measure.py",
    "code/torchbook/flops.py",
    "code/torchbook/models.py",
    "code/torchbook/profiles.py",
    "examples/gpu_results.py",
)


def run_memory(out: Output, profile: Profile, sizes: MemorySizes) -> Path:
    """Chapter 7's GPT at its longest context: tokens/s, FLOPs/token, MFU, peak memory.

    MFU is against the device's measured matmul peak, which is recorded beside it.
    """
    steps = max(sizes.seq_lens)
    config = GPTConfig(
        sizes.vocab_size, steps, sizes.n_layer, sizes.n_head, sizes.d_model
    )
    torch.manual_seed(profile.seed)
    model = GPT(config).to(profile.device).train()
    # fused: one kernel for every parameter, as the book's Trainer builds it
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    idx = torch.randint(
        0, sizes.vocab_size, (sizes.batch_size, steps), device=profile.device
    )
    targets = idx.roll(-1, dims=1)
    started = time.perf_counter()
    peak_rate = matmul_flops_per_second(
        sizes.matmul_size, profile.device, AUTOCAST_DTYPES[profile.precision]
    )
    metrics = throughput_metrics(
        model, optimizer, idx, targets, profile.precision, sizes.timed_steps, peak_rate
    )
    states = state_bytes(model, optimizer)
    metrics["peak_bytes"] = (
        states["parameters"]
        + states["optimizer_states"]
        + peak_bytes(
            lambda: training_step(model, optimizer, idx, targets, profile.precision),
            profile.device,
        )
    )
    metrics["predicted_peak_bytes"] = predict_peak(
        config,
        TrainingShape(
            sizes.batch_size, steps, profile.precision, device_type=profile.device.type
        ),
    )
    provenance = make_provenance(
        profile.device, repository_root(), MEMORY_SOURCES, time.perf_counter() - started
    )
    path = out.write("memory", profile, metrics, {}, provenance)
    print(
        f"memory: {metrics['tokens_per_second']:,.0f} tokens/s, MFU {metrics['mfu']:.1%}, peak "
        f"{metrics['peak_bytes'] / 1e9:.2f} GB (predicted {metrics['predicted_peak_bytes'] / 1e9:.2f}) -> {path}",
        flush=True,
    )
    return path


# ----- the dry run: each run's training step at full size, on fake tensors -----

DRY_RUN_SOURCES = (
    "code/torchbook/dry_run.py",
    "code/torchbook/gpu_fit.py",
    "code/torchbook/memory.py",
    "code/torchbook/memory_measure.py",
)
# Each run's steps (torchbook.dry_run.gpu_steps), by the prefix of their metrics:
# the memory run's file also holds chapter 7's float32 cell.
DRY_RUN_STEPS = {
    "lm": {"": "lm"},
    "lab": {"": "lab"},
    "compile": {"": "compile"},
    "memory": {"": "memory", "fp32.": "memory-fp32"},
}
RUN_SOURCES = {
    "lm": LM_SOURCES,
    "lab": LAB_SOURCES,
    "compile": COMPILE_SOURCES,
    "memory": MEMORY_SOURCES,
}


def dry_run(out: Output, profile: Profile, runs: list[str]) -> list[Path]:
    """Each run's step on fake tensors at ``profile``'s sizes: its peak, the formula's.

    Writes ``<run>-gpu-dry-run.json`` per run, in the results format, with
    ``fake_peak_bytes`` and ``predicted_peak_bytes`` (the formula with the
    CPU's kernels, which the fake step ran) and ``predicted_peak_bytes_cuda``.
    """
    corpus = load_corpus(shakespeare_path())
    steps = gpu_steps(profile, len(corpus.vocabulary))
    print(
        f"{'step at gpu sizes, fake tensors on the CPU':64s}"
        f"{'fake peak':>11s}{'formula':>11s}{'on CUDA':>11s}"
    )
    paths = []
    for run in runs:
        started, metrics = time.perf_counter(), {}
        for prefix, key in DRY_RUN_STEPS[run].items():
            step = steps[key]
            peak = fake_peak_bytes(step.build)
            metrics |= {
                f"{prefix}fake_peak_bytes": peak,
                f"{prefix}predicted_peak_bytes": step.formula,
                f"{prefix}predicted_peak_bytes_cuda": step.formula_cuda,
            }
            print(
                f"{step.name:64s}{peak / 1e9:>8.3f} GB{step.formula / 1e9:>8.3f} GB"
                f"{step.formula_cuda / 1e9:>8.3f} GB",
                flush=True,
            )
        provenance = make_provenance(
            profile.device,
            repository_root(),
            (*RUN_SOURCES[run], *DRY_RUN_SOURCES),
            time.perf_counter() - started,
        )
        paths.append(out.write(run, profile, metrics, {}, provenance))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=repository_root() / "assets" / "results",
        help="folder for the JSON files (default: assets/results)",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="cap the language model's optimizer steps (for quick checks)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="each run's step at the gpu sizes on fake tensors, no GPU needed; "
        "files marked as a dry run",
    )
    parser.add_argument(
        "--only",
        choices=RUNS,
        action="append",
        help="run only these (repeatable); default: every run",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    profile = gpu_profile(FAKE_DEVICE) if args.dry_run else active_profile()
    kind = "a dry run of the gpu sizes" if args.dry_run else "results"
    print(
        f"profile {profile.name}: device {profile.device}, torch {torch.__version__}; {kind}",
        flush=True,
    )
    chosen = [run for run in RUNS if run in (args.only or RUNS)]
    if args.dry_run:
        paths = dry_run(Output(args.out, dry_run=True), profile, chosen)
        print(f"dry run: {len(paths)} files in {args.out}", flush=True)
    else:
        out = Output(args.out)
        lm_sizes = (
            profile.lm
            if args.max_steps is None
            else shorter(profile.lm, args.max_steps)
        )
        if "lm" in chosen:
            run_language_model(out, profile, lm_sizes)
        if "lab" in chosen:
            run_lab(out, profile, profile.lab)
        if "compile" in chosen:
            run_compile(out, profile, profile.lm)
        if "memory" in chosen:
            run_memory(out, profile, profile.memory)
    print(f"gpu-results: done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
