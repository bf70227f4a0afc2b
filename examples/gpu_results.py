"""Rebuild every full-size result the book shows, as JSON files with provenance (``make gpu-results``).

Run on a GPU machine with the gpu profile (``QUARTO_PROFILE=gpu``, what ``make
gpu-results`` sets), it trains chapter 3's language model at full size in
bf16, runs the lab's drills, times ``torch.compile`` on chapter 3's model and
measures chapter 7's GPT-2-sized model (tokens per second, MFU, peak memory),
and writes one file per run, ``<run>-<profile>.json``, into ``--out``
(``assets/results/``). With the cpu profile it writes the same files from the
small sizes; ``--max-steps`` shortens the language-model run further.

``--dry-run`` (``make gpu-results DRY_RUN=1``) runs every one of these at the
gpu profile's sizes and precision on the CPU, for a handful of steps each: the
configs, shapes, autocast, the results format and the files all meet the full
sizes before a GPU hour is paid for. Its files are named
``<run>-gpu-dry-run.json`` and marked ``dry_run``; the chapters never plot them.

The chapters read these files and plot them beside their live CPU run; each
file records the hashes of the sources it depends on, so a figure can say when
the code has changed since.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchbook.charlm import (
    build,
    load_corpus,
    random_blocks,
    train_char_lm,
    unigram_baseline,
)
from torchbook.device import AUTOCAST_DTYPES, synchronize
from torchbook.download import repository_root, shakespeare_path
from torchbook.files import atomic_write
from torchbook.flops import matmul_flops_per_second, throughput_metrics
from torchbook.lab import MnistTensors, evaluate, fresh_model, load_data, test_logits
from torchbook.memory import (
    TrainingShape,
    peak_bytes,
    predict_peak,
    state_bytes,
    training_step,
)
from torchbook.mnist import resident_batches
from torchbook.models import GPT, GPTConfig
from torchbook.optim import OptimizerConfig, build_optimizer, build_schedule
from torchbook.profiles import (
    LabSizes,
    LanguageModelSizes,
    MemorySizes,
    Profile,
    active_profile,
    gpu_profile,
)
from torchbook.results import history_series, make_provenance, write_result

DRY_RUN_STEPS = (
    2  # optimizer steps of each run in a dry run: enough to take a step after the first
)


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
COMPILE_TIMED_STEPS = (
    30  # steady steps timed per model, eager and compiled taking turns
)


def run_compile(
    out: Output,
    profile: Profile,
    sizes: LanguageModelSizes,
    warmup_steps: int = COMPILE_WARMUP_STEPS,
    timed_steps: int = COMPILE_TIMED_STEPS,
) -> Path:
    """Chapter 3's GPT at ``sizes``, eager against ``torch.compile``: first step and steady step."""
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
        synchronize(profile.device)
        started = time.perf_counter()
        trainers[name].train_step(batch)
        synchronize(profile.device)
        return time.perf_counter() - started

    started = time.perf_counter()
    # the compiled one includes compilation
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


# ----- the lab: chapter 8's seven drills at the profile's sizes -----

LAB_SOURCES = (
    "code/torchbook/lab.py",
    "code/torchbook/mnist.py",
    "code/torchbook/optim.py",
    "code/torchbook/profiles.py",
    "examples/gpu_results.py",
)


def lab_optimizer(
    name: str, model: nn.Module, sizes: LabSizes, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The book's AdamW (``"adamw"``) or SGD with momentum 0.9 (``"sgd"``), both on a cosine to ``min_lr``."""
    lr = sizes.lr if name == "adamw" else sizes.sgd_lr
    config = OptimizerConfig(
        max_steps=total_steps,
        lr=lr,
        min_lr=sizes.min_lr * lr / sizes.lr,
        warmup_steps=0,
        weight_decay=sizes.weight_decay,
    )
    if name == "adamw":
        return build_optimizer(model, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return optimizer, build_schedule(optimizer, config)


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    images: Tensor,
    labels: Tensor,
    batch_size: int,
    generator: torch.Generator,
    accum_steps: int = 1,
    autocast_dtype: torch.dtype | None = None,
    drop_last: bool = False,
    max_steps: int | None = None,
) -> list[Tensor]:
    """One epoch of optimizer steps, as chapter 8's drills write it; each step's loss stays on the device.

    Each micro-batch's loss is summed over its examples and divided by the
    whole batch's size, so ``accum_steps`` micro-batches give the gradient of
    the batch's mean loss.
    """
    model.train()
    losses = []
    for batch_images, batch_labels in resident_batches(
        images, labels, batch_size, generator, drop_last
    ):
        if max_steps is not None and len(losses) == max_steps:
            break
        step_loss = torch.zeros((), device=images.device)
        micro_batches = zip(
            batch_images.split(batch_size // accum_steps),
            batch_labels.split(batch_size // accum_steps),
            strict=False,
        )
        for micro_images, micro_labels in micro_batches:
            with torch.autocast(
                images.device.type,
                dtype=autocast_dtype or torch.float32,
                enabled=autocast_dtype is not None,
            ):
                logits = model(micro_images)
            loss = F.cross_entropy(logits.float(), micro_labels, reduction="sum") / len(
                batch_labels
            )
            loss.backward()
            step_loss += loss.detach()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
    return losses


def lab_run(
    data: MnistTensors,
    sizes: LabSizes,
    profile: Profile,
    optimizer_name: str = "adamw",
    accum_steps: int = 1,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[nn.Module, dict]:
    """``sizes.epochs`` epochs from the seeded weights in the seeded order; tests after each epoch."""
    model = fresh_model(sizes.hidden, profile.seed, profile.device)
    steps_per_epoch = math.ceil(len(data.train_labels) / sizes.batch_size)
    optimizer, scheduler = lab_optimizer(
        optimizer_name, model, sizes, sizes.epochs * steps_per_epoch
    )
    generator = torch.Generator().manual_seed(profile.seed)
    history: dict[str, list] = {
        "step_loss": [],
        "epoch_accuracy": [],
        "epoch_test_loss": [],
        "epoch_seconds": [],
    }
    for _ in range(sizes.epochs):
        synchronize(profile.device)
        started = time.perf_counter()
        losses = train_epoch(
            model,
            optimizer,
            scheduler,
            data.train_images,
            data.train_labels,
            sizes.batch_size,
            generator,
            accum_steps,
            autocast_dtype,
        )
        synchronize(profile.device)
        history["epoch_seconds"].append(time.perf_counter() - started)
        history["step_loss"] += torch.stack(losses).tolist()
        accuracy, loss = evaluate(
            model, data.test_images, data.test_labels, autocast_dtype
        )
        history["epoch_accuracy"].append(accuracy)
        history["epoch_test_loss"].append(loss)
    return model, history


def compile_timing(
    data: MnistTensors, sizes: LabSizes, profile: Profile, backend: str = "inductor"
) -> dict:
    """Drill 2: the first (compiling) step, then eager and compiled steps timed in alternation over an epoch."""
    models = {"eager": fresh_model(sizes.hidden, profile.seed, profile.device)}
    models["compiled"] = torch.compile(
        fresh_model(sizes.hidden, profile.seed, profile.device), backend=backend
    )
    steps = len(data.train_labels) // sizes.batch_size
    optimizers = {
        name: lab_optimizer("adamw", model, sizes, steps)
        for name, model in models.items()
    }
    seconds: dict[str, list[float]] = {name: [] for name in models}
    batches = list(
        resident_batches(
            data.train_images,
            data.train_labels,
            sizes.batch_size,
            torch.Generator().manual_seed(profile.seed),
            drop_last=True,
        )
    )
    for images, labels in batches:
        # alternate, so a change in load hits both alike
        for (
            name,
            model,
        ) in models.items():
            optimizer, scheduler = optimizers[name]
            synchronize(profile.device)
            started = time.perf_counter()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(profile.device)
            seconds[name].append(time.perf_counter() - started)
    eager_s, compiled_s = (
        statistics.median(seconds[name][1:]) for name in ("eager", "compiled")
    )
    return {
        "eager_first_step_s": seconds["eager"][0],
        "compiled_first_step_s": seconds["compiled"][0],
        "eager_step_s": eager_s,
        "compiled_step_s": compiled_s,
        "speedup": eager_s / compiled_s,
        "steps": steps,
    }


def accumulation_agreement(
    data: MnistTensors, sizes: LabSizes, profile: Profile
) -> dict:
    """Drill 4's comparison: weights after ``equivalence_steps`` steps of one batch and of accumulated micro-batches."""
    states = []
    for accum_steps in (1, sizes.accum_steps):
        model = fresh_model(sizes.hidden, profile.seed, profile.device)
        optimizer, scheduler = lab_optimizer(
            "adamw", model, sizes, sizes.equivalence_steps
        )
        train_epoch(
            model,
            optimizer,
            scheduler,
            data.train_images,
            data.train_labels,
            sizes.batch_size,
            torch.Generator().manual_seed(profile.seed),
            accum_steps,
            max_steps=sizes.equivalence_steps,
        )
        states.append(
            torch.cat([tensor.flatten() for tensor in model.state_dict().values()])
        )
    difference = (states[0] - states[1]).abs()
    return {
        "max_weight_difference": difference.max().item(),
        "fraction_beyond_1e-6": (difference > 1e-6).float().mean().item(),
    }


def save_and_reload(
    model: nn.Module, data: MnistTensors, sizes: LabSizes, folder: Path
) -> dict:
    """Drills 6 and 7: a state dict through ``torch.save`` and through safetensors, compared bit for bit."""
    before = test_logits(model, data.test_images)
    pickled = atomic_write(
        folder / "mlp.pt", lambda temporary: torch.save(model.state_dict(), temporary)
    )
    reloaded = fresh_model(sizes.hidden, 0, data.test_images.device)
    reloaded.load_state_dict(
        torch.load(pickled, map_location=data.test_images.device, weights_only=True)
    )
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    tensors = atomic_write(
        folder / "mlp.safetensors",
        lambda temporary: safetensors.torch.save_file(state, temporary),
    )
    loaded = safetensors.torch.load_file(tensors, device=str(data.test_images.device))
    return {
        "torch_save_bytes": pickled.stat().st_size,
        "safetensors_bytes": tensors.stat().st_size,
        "reload_bit_identical": torch.equal(
            before, test_logits(reloaded, data.test_images)
        ),
        "safetensors_equal": all(
            torch.equal(loaded[name], state[name]) for name in state
        ),
    }


def results_series(histories: dict[str, dict]) -> dict[str, dict[str, list[float]]]:
    """Each run's history as two series of a results file: ``<run>.steps`` and ``<run>.epochs``."""
    series = {}
    for name, history in histories.items():
        series[f"{name}.steps"] = {
            "step": [float(i + 1) for i in range(len(history["step_loss"]))],
            "loss": history["step_loss"],
        }
        series[f"{name}.epochs"] = {
            "epoch": [float(i + 1) for i in range(len(history["epoch_accuracy"]))],
            "accuracy": history["epoch_accuracy"],
            "test_loss": history["epoch_test_loss"],
            "seconds": history["epoch_seconds"],
        }
    return series


def run_lab(
    out: Output, profile: Profile, sizes: LabSizes, train_batches: int | None = None
) -> Path:
    """The seven drills at ``sizes``; writes ``lab-<profile>.json`` with every number and each run's history.

    ``train_batches`` keeps only that many batches of the training images (a dry run's handful of steps).
    """
    started = time.perf_counter()
    data = load_data(profile.device)
    if train_batches is not None:
        kept = train_batches * sizes.batch_size
        data = dataclasses.replace(
            data,
            train_images=data.train_images[:kept],
            train_labels=data.train_labels[:kept],
        )
    model, adamw = lab_run(data, sizes, profile)
    histories = {
        "adamw": adamw,
        "sgd": lab_run(data, sizes, profile, "sgd")[1],
        "accumulated": lab_run(data, sizes, profile, accum_steps=sizes.accum_steps)[1],
        "bf16": lab_run(data, sizes, profile, autocast_dtype=torch.bfloat16)[1],
    }
    metrics = {
        f"drill1.{key}": value
        for key, value in {
            "accuracy": adamw["epoch_accuracy"][-1],
            "train_seconds": sum(adamw["epoch_seconds"]),
        }.items()
    }
    metrics |= {
        f"drill2.{key}": value
        for key, value in compile_timing(data, sizes, profile).items()
    }
    metrics |= {
        f"drill4.{key}": value
        for key, value in accumulation_agreement(data, sizes, profile).items()
    }
    fp32_loss = evaluate(model, data.test_images, data.test_labels)[1]
    bf16_loss = evaluate(model, data.test_images, data.test_labels, torch.bfloat16)[1]
    metrics |= {
        "drill5.same_weights_fp32_loss": fp32_loss,
        "drill5.same_weights_bf16_loss": bf16_loss,
        "drill5.same_weights_relative_difference": abs(bf16_loss - fp32_loss)
        / fp32_loss,
    }
    with tempfile.TemporaryDirectory(prefix="lab-") as folder:
        metrics |= {
            f"drill6.{key}": float(value)
            for key, value in save_and_reload(model, data, sizes, Path(folder)).items()
        }
    for name in ("sgd", "accumulated", "bf16"):
        metrics[f"{name}.accuracy"] = histories[name]["epoch_accuracy"][-1]
    provenance = make_provenance(
        profile.device, repository_root(), LAB_SOURCES, time.perf_counter() - started
    )
    path = out.write("lab", profile, metrics, results_series(histories), provenance)
    print(
        f"lab: {metrics['drill1.accuracy']:.2%} after {sizes.epochs} epochs, compile speedup "
        f"{metrics['drill2.speedup']:.2f}x -> {path}",
        flush=True,
    )
    return path


# ----- chapter 7: memory, throughput and MFU of a GPT-2-sized model -----

MEMORY_SOURCES = (
    "code/torchbook/memory.py",
    "code/torchbook/flops.py",
    "code/torchbook/models.py",
    "code/torchbook/profiles.py",
    "examples/gpu_results.py",
)


def run_memory(out: Output, profile: Profile, sizes: MemorySizes) -> Path:
    """Chapter 7's GPT at its longest context: tokens/s, FLOPs per token, matmul peak, MFU, peak bytes."""
    steps = max(sizes.seq_lens)
    config = GPTConfig(
        sizes.vocab_size, steps, sizes.n_layer, sizes.n_head, sizes.d_model
    )
    torch.manual_seed(profile.seed)
    model = GPT(config).to(profile.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
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


def dry_run_sizes(profile: Profile) -> tuple[LanguageModelSizes, LabSizes, MemorySizes]:
    """The gpu sizes with every count of steps, evaluations and samples cut to a handful; no shape changes."""
    lm = dataclasses.replace(
        shorter(profile.lm, DRY_RUN_STEPS), eval_batches=1, sample_tokens=8
    )
    lab = dataclasses.replace(profile.lab, equivalence_steps=DRY_RUN_STEPS)
    memory = dataclasses.replace(profile.memory, timed_steps=1)
    return lm, lab, memory


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
        help="every run at the gpu sizes on the CPU for a few steps; files marked as a dry run",
    )
    parser.add_argument(
        "--only",
        choices=RUNS,
        action="append",
        help="run only these (repeatable); default: every run",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    profile = gpu_profile(torch.device("cpu")) if args.dry_run else active_profile()
    out = Output(args.out, dry_run=args.dry_run)
    kind = "a dry run of the gpu sizes" if args.dry_run else "results"
    print(
        f"profile {profile.name}: device {profile.device}, torch {torch.__version__}; {kind}",
        flush=True,
    )
    chosen = args.only or list(RUNS)
    if args.dry_run:
        lm_sizes, lab_sizes, memory_sizes = dry_run_sizes(profile)
        compile_steps, train_batches = (0, 1), DRY_RUN_STEPS
    else:
        lm_sizes = (
            profile.lm
            if args.max_steps is None
            else shorter(profile.lm, args.max_steps)
        )
        lab_sizes, memory_sizes = profile.lab, profile.memory
        compile_steps, train_batches = (COMPILE_WARMUP_STEPS, COMPILE_TIMED_STEPS), None
    if "lm" in chosen:
        run_language_model(out, profile, lm_sizes)
    if "lab" in chosen:
        run_lab(out, profile, lab_sizes, train_batches)
    if "compile" in chosen:
        run_compile(out, profile, profile.lm, *compile_steps)
    if "memory" in chosen:
        run_memory(out, profile, memory_sizes)
    print(f"gpu-results: done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
