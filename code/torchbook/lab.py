"""The lab: a 784-256-128-10 MLP on MNIST and the seven drills, as functions and as a script.

Chapter 7 calls these functions one drill at a time; ``python -m torchbook.lab
--profile cpu --out DIR`` (or ``--profile gpu``) runs all seven and writes
``DIR/lab-<profile>.json`` in the format of ``torchbook.results``: every
drill's numbers, the training histories and the provenance (device, versions,
date, git commit, hashes of the sources), so a GPU machine without Quarto can
produce the results the book plots.

Every run starts from ``torch.manual_seed(seed)`` for the weights and its own
``torch.Generator`` for the data order, so two runs that should see the same
batches in the same order do.

It builds on ``torchbook.mnist`` (the data), ``torchbook.optim`` and
``torchbook.train`` (optimizers, schedule, config), ``torchbook.cache`` (where
MNIST is) and ``torchbook.results`` (the results file).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchbook.cache import mnist_root, repository_root
from torchbook.files import atomic_write
from torchbook.mnist import resident_batches, resident_mnist
from torchbook.optim import build_optimizer, build_schedule
from torchbook.profiles import LabSizes, Profile, make_profile
from torchbook.results import make_provenance, write_result
from torchbook.train import TrainConfig

SAFETENSORS_HEADER_LENGTH_BYTES = 8  # a little-endian uint64 before the JSON header


@dataclass
class MnistTensors:
    """The whole of MNIST, normalized, resident on the training device."""

    train_images: Tensor
    train_labels: Tensor
    test_images: Tensor
    test_labels: Tensor


def load_data(device: torch.device) -> MnistTensors:
    """Both splits from the verified raw files, as tensors on ``device``."""
    train = resident_mnist(mnist_root(), train=True, device=device)
    test = resident_mnist(mnist_root(), train=False, device=device)
    return MnistTensors(*train, *test)


class MLP(nn.Module):
    """Flatten a 28x28 image, then Linear + ReLU per hidden width, then a Linear to 10 logits."""

    def __init__(self, hidden: tuple[int, ...] = (256, 128), inputs: int = 28 * 28, classes: int = 10) -> None:
        super().__init__()
        widths = (inputs, *hidden)
        layers: list[nn.Module] = [nn.Flatten()]
        for width_in, width_out in zip(widths, widths[1:]):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, images: Tensor) -> Tensor:
        return self.layers(images)


def train_config(sizes: LabSizes, total_steps: int) -> TrainConfig:
    """The book's ``TrainConfig`` for a lab run: no warmup, a cosine from ``lr`` to ``min_lr`` over the run."""
    return TrainConfig(max_steps=total_steps, lr=sizes.lr, min_lr=sizes.min_lr, warmup_steps=0,
                       weight_decay=sizes.weight_decay)


def make_optimizer(name: str, model: nn.Module, sizes: LabSizes, total_steps: int
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """``"adamw"``: the book's ``build_optimizer``; ``"sgd"``: momentum 0.9 (drill 3). Both follow the same cosine."""
    config = train_config(sizes, total_steps)
    if name == "adamw":
        return build_optimizer(model, config)
    if name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=sizes.sgd_lr, momentum=0.9)
        return optimizer, build_schedule(optimizer, config)
    raise ValueError(f"make_optimizer: name must be 'adamw' or 'sgd', got {name!r}")


def steps_per_epoch(data: MnistTensors, batch_size: int, drop_last: bool = False) -> int:
    count = len(data.train_labels)
    return count // batch_size if drop_last else math.ceil(count / batch_size)


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, images: Tensor, labels: Tensor,
                batch_size: int, generator: torch.Generator, accum_steps: int = 1,
                autocast_dtype: torch.dtype | None = None, drop_last: bool = False,
                max_steps: int | None = None) -> list[Tensor]:
    """One epoch of optimizer steps; returns each step's mean loss as a tensor on the device (no sync).

    With ``accum_steps > 1`` every batch is split into micro-batches of
    ``batch_size // accum_steps``. Each micro-batch's loss is summed over its
    examples and divided by the whole batch's size, so the gradients add up to
    the gradient of the batch's mean loss: the same update as one big batch.
    """
    model.train()
    device_type = images.device.type
    micro_batch_size = batch_size // accum_steps
    losses = []
    for batch_images, batch_labels in resident_batches(images, labels, batch_size, generator, drop_last):
        if max_steps is not None and len(losses) == max_steps:
            break
        step_loss = torch.zeros((), device=images.device)
        for x, y in zip(batch_images.split(micro_batch_size), batch_labels.split(micro_batch_size)):
            with torch.autocast(device_type, dtype=autocast_dtype or torch.float32,
                                enabled=autocast_dtype is not None):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, reduction="sum") / len(batch_labels)
            loss.backward()
            step_loss += loss.detach()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
    return losses


@torch.no_grad()
def test_logits(model: nn.Module, images: Tensor, autocast_dtype: torch.dtype | None = None) -> Tensor:
    """The model's float32 logits for ``images``, in eval mode."""
    was_training = model.training
    model.eval()
    with torch.autocast(images.device.type, dtype=autocast_dtype or torch.float32,
                        enabled=autocast_dtype is not None):
        logits = model(images).float()
    model.train(was_training)
    return logits


def evaluate(model: nn.Module, images: Tensor, labels: Tensor,
             autocast_dtype: torch.dtype | None = None) -> tuple[float, float]:
    """Test accuracy and mean cross-entropy loss."""
    logits = test_logits(model, images, autocast_dtype)
    accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
    return accuracy, F.cross_entropy(logits, labels).item()


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a clock read after it measures finished work."""
    if device.type != "cpu":
        torch.accelerator.synchronize()


def train_run(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, data: MnistTensors, sizes: LabSizes,
              seed: int, accum_steps: int = 1, autocast_dtype: torch.dtype | None = None) -> dict:
    """Train ``sizes.epochs`` epochs in the data order ``seed`` draws; test after each epoch.

    Returns the history: every step's loss, and per epoch the test accuracy,
    test loss and seconds of training (evaluation not included).
    """
    generator = torch.Generator().manual_seed(seed)
    device = data.train_images.device
    history: dict[str, list] = {"step_loss": [], "epoch_accuracy": [], "epoch_test_loss": [], "epoch_seconds": []}
    for _ in range(sizes.epochs):
        synchronize(device)
        started = time.perf_counter()
        losses = train_epoch(model, optimizer, scheduler, data.train_images, data.train_labels,
                             sizes.batch_size, generator, accum_steps, autocast_dtype)
        synchronize(device)
        history["epoch_seconds"].append(time.perf_counter() - started)
        history["step_loss"] += torch.stack(losses).tolist()
        accuracy, loss = evaluate(model, data.test_images, data.test_labels, autocast_dtype)
        history["epoch_accuracy"].append(accuracy)
        history["epoch_test_loss"].append(loss)
    return history


def fresh_model(sizes: LabSizes, seed: int, device: torch.device) -> nn.Module:
    """The MLP initialised from ``seed``: every run of the lab starts from the same weights."""
    torch.manual_seed(seed)
    return MLP(sizes.hidden).to(device)


def adamw_run(data: MnistTensors, profile: Profile, accum_steps: int = 1,
              autocast_dtype: torch.dtype | None = None) -> tuple[nn.Module, dict[str, Tensor], dict]:
    """A whole run from the seeded weights: (model, initial state dict, history)."""
    sizes = profile.lab
    model = fresh_model(sizes, profile.seed, profile.device)
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer, scheduler = make_optimizer("adamw", model, sizes,
                                          sizes.epochs * steps_per_epoch(data, sizes.batch_size))
    history = train_run(model, optimizer, scheduler, data, sizes, profile.seed, accum_steps, autocast_dtype)
    return model, initial, history


# ----- the seven drills -----


def drill_1(data: MnistTensors, profile: Profile) -> tuple[nn.Module, dict[str, Tensor], dict]:
    """Train the MLP with AdamW for ``epochs`` epochs: (model, initial weights, result)."""
    model, initial, history = adamw_run(data, profile)
    result = {"accuracy": history["epoch_accuracy"][-1], "epochs": profile.lab.epochs,
              "train_seconds": sum(history["epoch_seconds"]), "history": history}
    return model, initial, result


def timed_epoch(model: nn.Module, data: MnistTensors, profile: Profile, first_step_only: bool = False) -> float:
    """Seconds for one epoch of full batches (or only its first step), with a fresh AdamW."""
    sizes = profile.lab
    optimizer, scheduler = make_optimizer("adamw", model, sizes, steps_per_epoch(data, sizes.batch_size, True))
    synchronize(profile.device)
    started = time.perf_counter()
    train_epoch(model, optimizer, scheduler, data.train_images, data.train_labels, sizes.batch_size,
                torch.Generator().manual_seed(profile.seed), drop_last=True,
                max_steps=1 if first_step_only else None)
    synchronize(profile.device)
    return time.perf_counter() - started


def drill_2(data: MnistTensors, profile: Profile, compiled: nn.Module | None = None) -> dict:
    """Eager against ``torch.compile``: the compiling first step, then a steady epoch of each.

    ``compiled`` is ``torch.compile(fresh_model(...))`` unless given. Full
    batches only (``drop_last``), so the compiled model meets one shape and
    compiles once.
    """
    sizes = profile.lab
    eager = fresh_model(sizes, profile.seed, profile.device)
    if compiled is None:
        compiled = torch.compile(fresh_model(sizes, profile.seed, profile.device))
    eager_first_step_s = timed_epoch(eager, data, profile, first_step_only=True)
    compile_step_s = timed_epoch(compiled, data, profile, first_step_only=True)
    eager_epoch_s = timed_epoch(eager, data, profile)
    compiled_epoch_s = timed_epoch(compiled, data, profile)
    # The same weights both ways: compiled against the module it wraps. Called with
    # gradients enabled and in train mode, as in training, so no second compilation.
    sample = data.test_images[: sizes.batch_size]
    difference = (compiled(sample) - compiled._orig_mod(sample)).abs().max().item()
    return {"eager_first_step_s": eager_first_step_s, "compiled_first_step_s": compile_step_s,
            "eager_epoch_s": eager_epoch_s, "compiled_epoch_s": compiled_epoch_s,
            "speedup": eager_epoch_s / compiled_epoch_s, "max_logit_difference": difference,
            "steps_per_epoch": steps_per_epoch(data, sizes.batch_size, drop_last=True)}


def drill_3(data: MnistTensors, profile: Profile, adamw_history: dict, model: nn.Module | None = None,
            optimizer: torch.optim.Optimizer | None = None, scheduler=None) -> dict:
    """SGD with momentum 0.9 from the same weights and data order as drill 1's AdamW run.

    Without ``model``, ``optimizer`` and ``scheduler`` it builds the seeded MLP
    and ``make_optimizer("sgd", ...)``; the chapter passes its own.
    """
    sizes = profile.lab
    if model is None or optimizer is None or scheduler is None:
        model = fresh_model(sizes, profile.seed, profile.device)
        optimizer, scheduler = make_optimizer("sgd", model, sizes,
                                              sizes.epochs * steps_per_epoch(data, sizes.batch_size))
    history = train_run(model, optimizer, scheduler, data, sizes, profile.seed)
    return {"sgd_accuracy": history["epoch_accuracy"][-1],
            "adamw_accuracy": adamw_history["epoch_accuracy"][-1], "history": history}


def drill_4(data: MnistTensors, profile: Profile, big_batch_history: dict
            ) -> tuple[nn.Module, tuple[dict[str, Tensor], dict[str, Tensor]], dict]:
    """``accum_steps`` micro-batches against one batch of ``batch_size``, same weights and order.

    First ``equivalence_steps`` steps both ways, keeping the weights after them
    (big batch, accumulated); then a whole accumulated run, whose accuracy is
    compared with drill 1's. Returns (accumulated model, the two states, result).
    """
    sizes = profile.lab
    states = []
    for accum_steps in (1, sizes.accum_steps):
        model = fresh_model(sizes, profile.seed, profile.device)
        optimizer, scheduler = make_optimizer("adamw", model, sizes,
                                              sizes.epochs * steps_per_epoch(data, sizes.batch_size))
        train_epoch(model, optimizer, scheduler, data.train_images, data.train_labels, sizes.batch_size,
                    torch.Generator().manual_seed(profile.seed), accum_steps, max_steps=sizes.equivalence_steps)
        states.append(model.state_dict())
    difference = max((states[0][name] - states[1][name]).abs().max().item() for name in states[0])
    model, _, history = adamw_run(data, profile, accum_steps=sizes.accum_steps)
    return model, (states[0], states[1]), {"max_weight_difference": difference, "compared_steps": sizes.equivalence_steps,
                   "accum_accuracy": history["epoch_accuracy"][-1],
                   "big_batch_accuracy": big_batch_history["epoch_accuracy"][-1], "history": history}


def drill_5(data: MnistTensors, profile: Profile, fp32_model: nn.Module, fp32_history: dict
            ) -> tuple[nn.Module, dict]:
    """bf16 autocast: the same weights evaluated both ways, then a run trained in bf16 against fp32's."""
    _, fp32_loss = evaluate(fp32_model, data.test_images, data.test_labels)
    _, autocast_loss = evaluate(fp32_model, data.test_images, data.test_labels, torch.bfloat16)
    model, _, history = adamw_run(data, profile, autocast_dtype=torch.bfloat16)
    trained_fp32_loss = fp32_history["epoch_test_loss"][-1]
    trained_bf16_loss = history["epoch_test_loss"][-1]
    return model, {
        "same_weights_fp32_loss": fp32_loss, "same_weights_bf16_loss": autocast_loss,
        "same_weights_relative_difference": abs(autocast_loss - fp32_loss) / fp32_loss,
        "trained_fp32_loss": trained_fp32_loss, "trained_bf16_loss": trained_bf16_loss,
        "trained_relative_difference": abs(trained_bf16_loss - trained_fp32_loss) / trained_fp32_loss,
        "fp32_accuracy": fp32_history["epoch_accuracy"][-1], "bf16_accuracy": history["epoch_accuracy"][-1],
        "history": history,
    }


def drill_6(model: nn.Module, data: MnistTensors, profile: Profile, folder: Path) -> tuple[nn.Module, dict]:
    """Save the weights with ``torch.save``, load them into a new MLP, compare the test logits bit for bit."""
    path = atomic_write(Path(folder) / "mlp.pt", lambda temporary: torch.save(model.state_dict(), temporary))
    reloaded = MLP(profile.lab.hidden).to(profile.device)
    reloaded.load_state_dict(torch.load(path, map_location=profile.device, weights_only=True))
    before, after = test_logits(model, data.test_images), test_logits(reloaded, data.test_images)
    return reloaded, {"path": str(path), "bytes": path.stat().st_size,
                      "bit_identical": torch.equal(before, after),
                      "accuracy_before": (before.argmax(1) == data.test_labels).float().mean().item(),
                      "accuracy_after": (after.argmax(1) == data.test_labels).float().mean().item()}


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: 8 bytes of length (little-endian), then that much JSON."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(SAFETENSORS_HEADER_LENGTH_BYTES), "little")
        return json.loads(handle.read(length))


def drill_7(model: nn.Module, folder: Path) -> tuple[dict[str, Tensor], dict]:
    """Write the weights as safetensors, read them back (tensors only: no pickle), show the header."""
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    path = atomic_write(Path(folder) / "mlp.safetensors",
                        lambda temporary: safetensors.torch.save_file(state, temporary))
    loaded = safetensors.torch.load_file(path, device=str(next(model.parameters()).device))
    equal = loaded.keys() == state.keys() and all(torch.equal(loaded[name], state[name]) for name in state)
    return loaded, {"path": str(path), "bytes": path.stat().st_size, "tensors_equal": equal,
                    "header": read_safetensors_header(path)}


# ----- the script -----


# What the lab's numbers depend on: a change to any of these makes a stored result stale.
LAB_SOURCES = ("code/torchbook/lab.py", "code/torchbook/mnist.py", "code/torchbook/train.py",
               "code/torchbook/profiles.py")


def results_metrics(drills: dict[str, dict]) -> dict[str, float]:
    """Every number of every drill, flattened for a results file: ``{"drill1.accuracy": 0.981, ...}``.

    Booleans become 1.0 or 0.0; strings and the safetensors header are left out
    (the chapter shows them live).
    """
    metrics = {}
    for number, result in drills.items():
        for key, value in result.items():
            if isinstance(value, (bool, int, float)):
                metrics[f"drill{number}.{key}"] = float(value)
    return metrics


def results_series(histories: dict[str, dict]) -> dict[str, dict[str, list[float]]]:
    """Each run's history as two series of a results file: ``<run>.steps`` and ``<run>.epochs``."""
    series = {}
    for name, history in histories.items():
        series[f"{name}.steps"] = {"step": [float(i + 1) for i in range(len(history["step_loss"]))],
                                   "loss": history["step_loss"]}
        series[f"{name}.epochs"] = {"epoch": [float(i + 1) for i in range(len(history["epoch_accuracy"]))],
                                    "accuracy": history["epoch_accuracy"], "test_loss": history["epoch_test_loss"],
                                    "seconds": history["epoch_seconds"]}
    return series


def run_lab(profile: Profile, folder: Path | None = None) -> dict:
    """All seven drills in order; returns ``{"drills": ..., "histories": ...}``, what ``main`` writes.

    Drills 6 and 7 write the weights into ``folder``, or into a temporary
    folder deleted afterwards when it is None; the document names the files only.
    """
    data = load_data(profile.device)
    model, _, first = drill_1(data, profile)
    histories = {"adamw": first.pop("history")}
    drills = {"1": first, "2": drill_2(data, profile)}
    third = drill_3(data, profile, histories["adamw"])
    histories["sgd"] = third.pop("history")
    _, _, fourth = drill_4(data, profile, histories["adamw"])
    histories["accumulated"] = fourth.pop("history")
    _, fifth = drill_5(data, profile, model, histories["adamw"])
    histories["bf16"] = fifth.pop("history")
    with tempfile.TemporaryDirectory(prefix="lab-") as temporary:
        _, sixth = drill_6(model, data, profile, folder or Path(temporary))
        _, seventh = drill_7(model, folder or Path(temporary))
    for result in (sixth, seventh):
        result["path"] = Path(result["path"]).name
    drills.update({"3": third, "4": fourth, "5": fifth, "6": sixth, "7": seventh})
    return {"drills": drills, "histories": histories}


def write_lab_results(profile: Profile, out: Path) -> Path:
    """Run all seven drills and write ``out/lab-<profile>.json``; returns its path."""
    started = time.perf_counter()
    results = run_lab(profile)
    provenance = make_provenance(profile.device, repository_root(), LAB_SOURCES, time.perf_counter() - started)
    for number, result in results["drills"].items():
        summary = {key: value for key, value in result.items() if isinstance(value, (int, float, bool))}
        print(f"drill {number}: {summary}", flush=True)
    return write_result(Path(out) / f"lab-{profile.name}.json", "lab", profile.name,
                        results_metrics(results["drills"]), results_series(results["histories"]), provenance)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the lab's seven drills and write their results as JSON.")
    parser.add_argument("--profile", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--out", type=Path, required=True, help="folder for lab-<profile>.json")
    args = parser.parse_args(argv)
    print(f"results: {write_lab_results(make_profile(args.profile), args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
