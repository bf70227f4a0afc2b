"""Rebuild every full-size result the book shows, as JSON files with provenance (``make gpu-results``).

Run on a GPU machine with the gpu profile (``QUARTO_PROFILE=gpu``, what ``make
gpu-results`` sets), it trains chapter 3's language model at full size in
bf16, runs the lab's drills and times ``torch.compile`` on that model, and writes one file
per run, ``<run>-<profile>.json``, into ``--out`` (``assets/results/``). With
the cpu profile it writes the same files from the small sizes; ``--max-steps``
shortens the language-model run further, which is how the tests exercise it.

The chapters read these files and plot them beside their live CPU run; each
file records the hashes of the sources it depends on, so a figure can say when
the code has changed since.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

from torchbook.cache import repository_root, shakespeare_path
from torchbook.charlm import build, load_corpus, random_blocks, train_char_lm, unigram_baseline
from torchbook.lab import write_lab_results
from torchbook.profiles import active_profile
from torchbook.results import history_series, make_provenance, write_result

# What each run's numbers depend on: a change to any of these makes its file stale.
LM_SOURCES = ("code/torchbook/charlm.py", "code/torchbook/models.py", "code/torchbook/train.py",
              "code/torchbook/profiles.py", "examples/gpu_results.py")


def run_language_model(out: Path, max_steps: int | None) -> Path:
    """Chapter 3's character-level GPT at the profile's sizes; returns the results file."""
    profile = active_profile()
    sizes = profile.lm
    if max_steps is not None:
        sizes = dataclasses.replace(sizes, max_steps=max_steps, warmup_steps=min(sizes.warmup_steps, max_steps),
                                    eval_every=min(sizes.eval_every, max_steps),
                                    log_every=min(sizes.log_every, max_steps))
    corpus = load_corpus(shakespeare_path())
    started = time.perf_counter()
    run = train_char_lm(corpus, sizes, profile.device, profile.autocast_dtype, profile.seed)
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
    provenance = make_provenance(profile.device, repository_root(), LM_SOURCES, time.perf_counter() - started)
    path = write_result(out / f"lm-{profile.name}.json", "lm", profile.name, metrics, series, provenance)
    print(f"lm: {run.trainer.step} steps in {run.train_seconds:.1f} s, validation loss "
          f"{metrics['final_val_loss']:.3f} nats/char -> {path}", flush=True)
    return path


RUNS = ("lm", "lab", "compile")


COMPILE_SOURCES = ("code/torchbook/charlm.py", "code/torchbook/models.py", "code/torchbook/train.py",
                   "code/torchbook/profiles.py", "examples/gpu_results.py")
COMPILE_WARMUP_STEPS = 3  # after the first step: the allocator and caches settle
COMPILE_TIMED_STEPS = 30  # steady steps timed per model, eager and compiled taking turns


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_compile(out: Path) -> Path:
    """Chapter 3's GPT at the profile's sizes, eager against ``torch.compile``: first step and steady step."""
    profile = active_profile()
    corpus = load_corpus(shakespeare_path())
    batch = [next(random_blocks(corpus.train_tokens, profile.lm.block_size, profile.lm.batch_size,
                                torch.Generator().manual_seed(profile.seed)))]
    trainers = {name: build(corpus, profile.lm, profile.device, profile.autocast_dtype, profile.seed)
                for name in ("eager", "compiled")}
    trainers["compiled"].model = torch.compile(trainers["compiled"].model)

    def timed_step(name: str) -> float:
        synchronize(profile.device)
        started = time.perf_counter()
        trainers[name].train_step(batch)
        synchronize(profile.device)
        return time.perf_counter() - started

    started = time.perf_counter()
    first = {name: timed_step(name) for name in trainers}  # the compiled one includes compilation
    for _ in range(COMPILE_WARMUP_STEPS):
        for name in trainers:
            timed_step(name)
    steps = {name: [] for name in trainers}
    for _ in range(COMPILE_TIMED_STEPS):  # alternate, so a change in load hits both alike
        for name in trainers:
            steps[name].append(timed_step(name))
    step = {name: statistics.median(times) for name, times in steps.items()}
    metrics = {
        "eager_first_step_s": first["eager"], "compiled_first_step_s": first["compiled"],
        "eager_step_s": step["eager"], "compiled_step_s": step["compiled"],
        "speedup": step["eager"] / step["compiled"], "compile_s": first["compiled"] - step["compiled"],
        "tokens_per_step": profile.lm.block_size * profile.lm.batch_size,
    }
    history = {name: {"step": [float(i + 1) for i in range(COMPILE_TIMED_STEPS)], "seconds": times}
               for name, times in steps.items()}
    provenance = make_provenance(profile.device, repository_root(), COMPILE_SOURCES, time.perf_counter() - started)
    path = write_result(out / f"compile-{profile.name}.json", "compile", profile.name, metrics, history, provenance)
    print(f"compile: {metrics['speedup']:.2f}x steady-state, compilation {metrics['compile_s']:.1f} s -> {path}",
          flush=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=repository_root() / "assets" / "results",
                        help="folder for the JSON files (default: assets/results)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="cap the language model's optimizer steps (for quick checks)")
    parser.add_argument("--only", choices=RUNS, action="append",
                        help="run only these (repeatable); default: every run")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    profile = active_profile()
    print(f"profile {profile.name}: device {profile.device}, torch {torch.__version__}", flush=True)
    chosen = args.only or list(RUNS)
    if "lm" in chosen:
        run_language_model(args.out, args.max_steps)
    if "lab" in chosen:
        print(f"lab: -> {write_lab_results(profile, args.out)}", flush=True)
    if "compile" in chosen:
        run_compile(args.out)
    print(f"gpu-results: done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
