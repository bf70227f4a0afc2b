"""Rebuild every full-size result the book shows as JSON files with provenance.

Run on a GPU machine with the gpu profile (``QUARTO_PROFILE=gpu``, what ``make
gpu-results`` sets), it trains chapter 3's language model at full size in
bf16, runs the lab's drills, times ``torch.compile`` on chapter 3's model and
measures chapter 7's GPT-2-sized model (tokens per second, MFU, peak memory),
and writes one file per run, ``<run>-<profile>.json``, into ``--out``
(``assets/results/``). With the cpu profile it writes the same files from the
small sizes; ``--max-steps`` shortens the language-model run further.

``--dry-run`` (``make gpu-results DRY_RUN=1``) needs no GPU: it calls the
same run functions at the gpu profile's shapes and precision on fake tensors
(``torchbook.book.dry_run``), which have shapes but no data, so a change that
breaks the GPU job breaks the dry run too. It keeps every shape and cuts every
count (two optimizer steps, two validation batches, a few batches per lab
epoch, one timed step) and runs the language model in fp16 too, the
precision of a GPU without bf16. What cannot run on fake tensors it switches,
and prints the list: values read from the model are a placeholder, and the
compile runs trace with aot_eager instead of generating Inductor's kernels.
Its files, ``<run>-gpu-dry-run.json``, are marked ``dry_run``; the chapters
never read them.

Each file records the hashes of the sources its run depends on, derived from
the names the run function uses (``torchbook.book.results.run_sources``); the
appendix lists the files with the device and date each was made on, and
whether its code has changed since.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch

from torchbook.book.charlm import (
    build,
    load_corpus,
    random_blocks,
    train_char_lm,
    unigram_baseline,
)
from torchbook.book.download import repository_root, shakespeare_path
from torchbook.book.dry_run import FAKE_DEVICE, SWITCHED, FakeRun, fake_run
from torchbook.book.lab import load_data, run_drills
from torchbook.book.profiles import (
    LabSizes,
    LanguageModelSizes,
    MemorySizes,
    Profile,
    active_profile,
    gpu_profile,
    make_profile,
)
from torchbook.book.results import (
    history_series,
    import_closure,
    make_provenance,
    read_result,
    run_sources,
    write_result,
)
from torchbook.device import AUTOCAST_DTYPES, timed
from torchbook.memory import TrainingSetup
from torchbook.memory.flops import matmul_flops_per_second, throughput_metrics
from torchbook.memory.gpt import predict_peak
from torchbook.memory.measure import peak_bytes, state_bytes, training_step
from torchbook.models import GPT, GPTConfig

SCRIPT = "examples/gpu_results.py"  # a source of every run


class Output(NamedTuple):
    """Where a run writes its file, and the dry run's mode if it is one."""

    folder: Path
    fake: FakeRun | None = None  # a dry run: its numbers are of fake tensors

    def path(self, run: str, profile: Profile) -> Path:
        suffix = "-dry-run" if self.fake else ""
        return self.folder / f"{run}-{profile.name}{suffix}.json"

    def write(
        self,
        run: str,
        profile: Profile,
        metrics: dict,
        history: dict,
        function: Callable,
        seconds: float,
    ) -> Path:
        """The results file of ``function``'s run, with its sources' hashes."""
        sources = run_sources(function, SCRIPT, repository_root())
        if self.fake:  # the dry run's own code, and what it measured
            dry_run = import_closure(["torchbook.book.dry_run"], repository_root())
            sources = sorted({*sources, *dry_run})
            metrics = {
                **metrics,
                "dry_run.peak_bytes": self.fake.memory.peak,
                "dry_run.placeholder_reads": sum(self.fake.placeholders.values()),
            }
        provenance = make_provenance(
            profile.device, repository_root(), sources, seconds
        )
        return write_result(
            self.path(run, profile),
            run,
            profile.name,
            metrics,
            history,
            provenance,
            dry_run=self.fake is not None,
        )

    def footprint(
        self,
        step: Callable[[], object],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
    ) -> int:
        """Peak bytes of ``step()`` with the parameters and optimizer states.

        A dry run counts every fake tensor alive at the step's peak, the
        buffers and the batch too.
        """
        if self.fake:
            return self.fake.memory.live + self.fake.memory.peak_bytes(step)
        states = state_bytes(model, optimizer)
        existing = states["parameters"] + states["optimizer_states"]
        return existing + peak_bytes(step, device)


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
    seconds = time.perf_counter() - started
    path = out.write("lm", profile, metrics, series, run_language_model, seconds)
    print(
        f"lm: {run.trainer.step} steps in {run.train_seconds:.1f} s, validation loss "
        f"{metrics['final_val_loss']:.3f} nats/char -> {path}",
        flush=True,
    )
    return path


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
    seconds = time.perf_counter() - started
    path = out.write("compile", profile, metrics, history, run_compile, seconds)
    print(
        f"compile: {metrics['speedup']:.2f}x steady-state, "
        f"compilation {metrics['compile_s']:.1f} s -> {path}",
        flush=True,
    )
    return path


# ----- the lab: chapter 10's seven drills at the profile's sizes -----


def run_lab(
    out: Output, profile: Profile, sizes: LabSizes, train_examples: int | None = None
) -> Path:
    """The seven drills at ``sizes``; numbers, histories to ``lab-<profile>.json``.

    ``train_examples`` cuts MNIST's training split (the dry run's few steps).
    """
    started = time.perf_counter()
    data = load_data(profile.device)
    if train_examples is not None:
        data = dataclasses.replace(
            data,
            train_images=data.train_images[:train_examples],
            train_labels=data.train_labels[:train_examples],
        )
    metrics, series = run_drills(data, sizes, profile)
    seconds = time.perf_counter() - started
    path = out.write("lab", profile, metrics, series, run_lab, seconds)
    print(
        f"lab: {metrics['drill1.accuracy']:.2%} after {sizes.epochs} epochs, "
        f"compile speedup {metrics['drill2.speedup']:.2f}x -> {path}",
        flush=True,
    )
    return path


# ----- chapter 7: memory, throughput and MFU of a GPT-2-sized model -----


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
    metrics["peak_bytes"] = out.footprint(
        lambda: training_step(model, optimizer, idx, targets, profile.precision),
        model,
        optimizer,
        profile.device,
    )
    metrics["predicted_peak_bytes"] = predict_peak(
        config,
        TrainingSetup(
            sizes.batch_size,
            steps,
            profile.precision,
            kernels="cpu" if profile.device.type == "cpu" else "cuda",
        ),
    )
    seconds = time.perf_counter() - started
    path = out.write("memory", profile, metrics, {}, run_memory, seconds)
    print(
        f"memory: {metrics['tokens_per_second']:,.0f} tokens/s, "
        f"MFU {metrics['mfu']:.1%}, peak {metrics['peak_bytes'] / 1e9:.2f} GB "
        f"(predicted {metrics['predicted_peak_bytes'] / 1e9:.2f}) -> {path}",
        flush=True,
    )
    return path


# The runs of ``make gpu-results``, by name (``--only``), in order.
RUN_FUNCTIONS = {
    "lm": run_language_model,
    "lab": run_lab,
    "compile": run_compile,
    "memory": run_memory,
}
RUNS = tuple(RUN_FUNCTIONS)


# ----- the dry run: the same runs on fake tensors, every shape kept, counts cut -----

# Optimizer steps of the dry run's language model: the second logs and validates.
DRY_RUN_STEPS = 2


def dry_run_calls(profile: Profile) -> dict[str, list[Callable[[Output], Path]]]:
    """Each run's calls in the dry run: its function, shapes kept, counts cut.

    The language model runs in ``profile``'s precision and in fp16, whose
    loss scaler the GPU job never meets in bf16.
    """
    lm = dataclasses.replace(
        shorter(profile.lm, DRY_RUN_STEPS), eval_batches=DRY_RUN_STEPS
    )
    fp16 = dataclasses.replace(profile, name=f"{profile.name}-fp16", precision="fp16")
    # two full batches and a partial one: drill 2 times its second step
    examples = 2 * profile.lab.batch_size + 1
    memory = dataclasses.replace(profile.memory, timed_steps=1)
    return {
        "lm": [
            partial(run_language_model, profile=profile, sizes=lm),
            partial(run_language_model, profile=fp16, sizes=lm),
        ],
        "lab": [
            partial(
                run_lab, profile=profile, sizes=profile.lab, train_examples=examples
            )
        ],
        "compile": [
            partial(
                run_compile,
                profile=profile,
                sizes=profile.lm,
                warmup_steps=1,
                timed_steps=1,
            )
        ],
        "memory": [partial(run_memory, profile=profile, sizes=memory)],
    }


def dry_run(folder: Path, profile: Profile, runs: list[str]) -> list[Path]:
    """Each run's calls on fake tensors; prints each run's fake peak and placeholders.

    Writes ``<run>-<profile>-dry-run.json`` per call, in the results format.
    """
    paths = []
    calls = dry_run_calls(profile)
    for run in runs:
        for call in calls[run]:
            with fake_run() as mode:
                path = call(Output(folder, mode))
            result = read_result(path)
            made_up = ", ".join(
                f"{caller} {count}" for caller, count in mode.placeholders.items()
            )
            print(
                f"  {path.name}: peak of tracked tensors "
                f"{result.metrics['dry_run.peak_bytes'] / 1e9:.3f} GB; "
                f"placeholders read: {made_up or 'none'}",
                flush=True,
            )
            paths.append(path)
    print("Not run on fake tensors, and what the dry run does instead:")
    for part, instead in SWITCHED.items():
        print(f"- {part}: {instead}")
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
        help="the same runs on fake tensors, no GPU needed; files marked as a dry run",
    )
    parser.add_argument(
        "--dry-run-sizes",
        choices=("gpu", "cpu"),
        default="gpu",
        help="the profile whose sizes the dry run takes (default: gpu; cpu is quicker)",
    )
    parser.add_argument(
        "--sources",
        action="store_true",
        help="print each run's source files (JSON) and stop",
    )
    parser.add_argument(
        "--only",
        choices=RUNS,
        action="append",
        help="run only these (repeatable); default: every run",
    )
    args = parser.parse_args(argv)
    if args.sources:
        root = repository_root()
        sources = {
            run: run_sources(function, SCRIPT, root)
            for run, function in RUN_FUNCTIONS.items()
        }
        print(json.dumps(sources, indent=1))
        return 0
    started = time.perf_counter()
    if not args.dry_run:
        profile = active_profile()
    elif args.dry_run_sizes == "gpu":
        profile = gpu_profile(FAKE_DEVICE)
    else:
        profile = make_profile("cpu")
    kind = f"a dry run of the {profile.name} sizes" if args.dry_run else "results"
    print(
        f"profile {profile.name}: device {profile.device}, "
        f"torch {torch.__version__}; {kind}",
        flush=True,
    )
    chosen = [run for run in RUNS if run in (args.only or RUNS)]
    if args.dry_run:
        paths = dry_run(args.out, profile, chosen)
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
