"""The lab's MNIST drills: the data, the 784-256-128-10 MLP, the runs that repeat them.

Chapter 10 writes each drill's own code (the training loop, the compile
timing, accumulation, autocast, saving) in its cells. The first half of this
module is what those cells share: the data on the training device, the model
built from a seed, and its evaluation in eval mode without gradients. The
second half runs the same drills as functions (``run_drills``), which
``examples/gpu_results.py`` calls at the gpu profile's sizes and
``bench/mnist_lab.py`` times against a bare loop.

It builds on ``torchbook.book.mnist`` (reading the verified raw files),
``torchbook.book.download`` (where those files are) and ``torchbook.optim`` (the
book's AdamW and schedule, which the drills train with) and
``torchbook.book.profiles`` (the sizes).
"""

from __future__ import annotations

import math
import re
import statistics
import tempfile
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchbook.book.download import mnist_root
from torchbook.book.mnist import resident_batches, resident_mnist
from torchbook.book.profiles import LabSizes, Profile
from torchbook.device import autocast, timed
from torchbook.files import atomic_write
from torchbook.optim import OptimizerConfig, build_optimizer, build_schedule

Scheduler = torch.optim.lr_scheduler.LRScheduler
# Drill 4 compares its two ways step by step with plain AdamW at this constant rate.
COMPARED_LR = 1e-3


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


class MnistMLP(nn.Module):
    """Flatten a 28x28 image, Linear + ReLU per hidden width, Linear to 10 logits."""

    def __init__(
        self,
        hidden: tuple[int, ...] = (256, 128),
        inputs: int = 28 * 28,
        classes: int = 10,
    ) -> None:
        super().__init__()
        widths = (inputs, *hidden)
        layers: list[nn.Module] = [nn.Flatten()]
        for width_in, width_out in pairwise(widths):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, images: Tensor) -> Tensor:
        return self.layers(images)


def fresh_model(hidden: tuple[int, ...], seed: int, device: torch.device) -> MnistMLP:
    """The MLP initialised from ``seed``: runs that should start alike do."""
    torch.manual_seed(seed)
    return MnistMLP(hidden).to(device)


@torch.no_grad()
def eval_logits(model: nn.Module, images: Tensor, precision: str = "fp32") -> Tensor:
    """The model's float32 logits in eval mode, under ``precision``'s autocast."""
    was_training = model.training
    model.eval()
    with autocast(images.device.type, precision):
        logits = model(images).float()
    model.train(was_training)
    return logits


def accuracy_and_loss(
    model: nn.Module, images: Tensor, labels: Tensor, precision: str = "fp32"
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy (in float32 even under autocast)."""
    logits = eval_logits(model, images, precision)
    accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
    return accuracy, F.cross_entropy(logits, labels).item()


def epochs_shuffled(order: torch.Generator, examples: int, most: int) -> int | None:
    """Epochs ``order`` has shuffled since it was seeded; None beyond ``most``.

    ``resident_batches`` draws one permutation of the ``examples`` per epoch
    from the generator it is given: replaying those draws from the same seed
    counts the epochs of a run, whatever batch size its loop used.
    """
    replay = torch.Generator(order.device).manual_seed(order.initial_seed())
    for epochs in range(most + 1):
        if torch.equal(replay.get_state(), order.get_state()):
            return epochs
        torch.randperm(examples, generator=replay, device=order.device)
    return None


# ----- the drills as functions: what examples/gpu_results.py reruns -----


def lab_optimizer(
    name: str, model: nn.Module, sizes: LabSizes, total_steps: int
) -> tuple[torch.optim.Optimizer, Scheduler]:
    """The book's AdamW (``"adamw"``) or SGD, momentum 0.9 (``"sgd"``), on a cosine."""
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
    scheduler: Scheduler,
    images: Tensor,
    labels: Tensor,
    batch_size: int,
    generator: torch.Generator,
    accum_steps: int = 1,
    precision: str = "fp32",
    drop_last: bool = False,
    max_steps: int | None = None,
) -> list[Tensor]:
    """One epoch of optimizer steps as chapter 10 writes them; losses stay on device.

    Each micro-batch's loss is summed over its examples and divided by the
    whole batch's size, so ``accum_steps`` micro-batches give the gradient of
    the batch's mean loss.
    """
    model.train()
    losses = []
    batches = resident_batches(images, labels, batch_size, generator, drop_last)
    for batch_images, batch_labels in batches:
        if len(losses) == max_steps:
            break
        step_loss = torch.zeros((), device=images.device)
        micro_size = batch_size // accum_steps
        micro_batches = zip(
            batch_images.split(micro_size),
            batch_labels.split(micro_size),
            strict=True,
        )
        for micro_images, micro_labels in micro_batches:
            with autocast(images.device.type, precision):
                logits = model(micro_images)
            summed = F.cross_entropy(logits.float(), micro_labels, reduction="sum")
            loss = summed / len(batch_labels)
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
    precision: str = "fp32",
) -> tuple[nn.Module, dict]:
    """``sizes.epochs`` epochs from the seeded weights and order, tested per epoch."""
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
        losses, epoch_s = timed(
            lambda: train_epoch(
                model,
                optimizer,
                scheduler,
                data.train_images,
                data.train_labels,
                sizes.batch_size,
                generator,
                accum_steps,
                precision,
            ),
            profile.device,
        )
        history["epoch_seconds"].append(epoch_s)
        history["step_loss"] += torch.stack(losses).tolist()
        accuracy, loss = accuracy_and_loss(
            model, data.test_images, data.test_labels, precision
        )
        history["epoch_accuracy"].append(accuracy)
        history["epoch_test_loss"].append(loss)
    return model, history


def _one_step(model, optimizer, scheduler, images: Tensor, labels: Tensor) -> None:
    """One plain training step, as drill 2 times it."""
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def compile_timing(
    data: MnistTensors, sizes: LabSizes, profile: Profile, backend: str = "inductor"
) -> dict:
    """Drill 2: the first (compiling) step, then eager and compiled steps in turn."""
    models = {
        "eager": fresh_model(sizes.hidden, profile.seed, profile.device),
        "compiled": torch.compile(
            fresh_model(sizes.hidden, profile.seed, profile.device), backend=backend
        ),
    }
    steps = len(data.train_labels) // sizes.batch_size
    optimizers = {
        name: lab_optimizer("adamw", model, sizes, steps)
        for name, model in models.items()
    }
    seconds: dict[str, list[float]] = {name: [] for name in models}
    batches = resident_batches(
        data.train_images,
        data.train_labels,
        sizes.batch_size,
        torch.Generator().manual_seed(profile.seed),
        drop_last=True,
    )
    for images, labels in batches:
        for name, model in models.items():  # alternate: load changes hit both alike
            _, step_s = timed(
                partial(_one_step, model, *optimizers[name], images, labels),
                profile.device,
            )
            seconds[name].append(step_s)
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


# A call in the code Inductor generates: a library's kernel (extern_kernels.addmm), a
# C++ kernel (cpp_fused_relu_0(...)) or a Triton one, which the wrapper launches with
# .run (triton_poi_fused_relu_0.run(...), as torch/_inductor/codegen/wrapper.py writes).
GENERATED_CALL = re.compile(
    r"^[ \t]+(extern_kernels\.\w+|cpp_fused_\w+|triton_\w+)(?:\.run)?\(", re.MULTILINE
)


def generated_calls(code: str) -> list[str]:
    """The library calls and generated kernels in Inductor's code, in order."""
    return GENERATED_CALL.findall(code)


def compared_steps(
    model: nn.Module,
    images: Tensor,
    labels: Tensor,
    order: torch.Generator,
    batch_size: int,
    micro_batch_size: int,
    steps: int,
    lr: float = COMPARED_LR,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Drill 4's comparison: ``steps`` steps of ``model``, in micro-batches.

    Returns copies of the first batch's gradients and of the weights after the
    steps. Plain AdamW at a constant ``lr``, without a schedule, so that the
    exercise notebook's checker repeats the big-batch run exactly. Each
    micro-batch's loss is summed and divided by the whole batch's size.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    first_grads = {}
    batches = resident_batches(images, labels, batch_size, order)
    for _, (batch_images, batch_labels) in zip(range(steps), batches, strict=False):
        micro_batches = zip(
            batch_images.split(micro_batch_size),
            batch_labels.split(micro_batch_size),
            strict=True,
        )
        for micro_images, micro_labels in micro_batches:
            summed = F.cross_entropy(model(micro_images), micro_labels, reduction="sum")
            (summed / len(batch_labels)).backward()
        if not first_grads:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return first_grads, {n: t.clone() for n, t in model.state_dict().items()}


def accumulation_agreement(
    data: MnistTensors, sizes: LabSizes, profile: Profile
) -> dict:
    """Drill 4: weights after ``equivalence_steps`` steps, one batch and accumulated."""
    states = []
    for micro_batch_size in (sizes.batch_size, sizes.micro_batch_size):
        _, state = compared_steps(
            fresh_model(sizes.hidden, profile.seed, profile.device),
            data.train_images,
            data.train_labels,
            torch.Generator().manual_seed(profile.seed),
            sizes.batch_size,
            micro_batch_size,
            sizes.equivalence_steps,
        )
        states.append(torch.cat([t.flatten() for t in state.values()]))
    difference = (states[0] - states[1]).abs()
    return {
        "max_weight_difference": difference.max().item(),
        "fraction_beyond_1e-6": (difference > 1e-6).float().mean().item(),
    }


def save_and_reload(
    model: nn.Module, data: MnistTensors, sizes: LabSizes, folder: Path
) -> dict:
    """Drills 6 and 7: the state dict through ``torch.save`` and safetensors."""
    device = data.test_images.device
    before = eval_logits(model, data.test_images)
    pickled = atomic_write(
        folder / "mlp.pt", lambda temporary: torch.save(model.state_dict(), temporary)
    )
    reloaded = fresh_model(sizes.hidden, 0, device)
    reloaded.load_state_dict(
        torch.load(pickled, map_location=device, weights_only=True)
    )
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    tensors = atomic_write(
        folder / "mlp.safetensors",
        lambda temporary: safetensors.torch.save_file(state, temporary),
    )
    loaded = safetensors.torch.load_file(tensors, device=str(device))
    after = eval_logits(reloaded, data.test_images)
    return {
        "torch_save_bytes": pickled.stat().st_size,
        "safetensors_bytes": tensors.stat().st_size,
        "reload_bit_identical": torch.equal(before, after),
        "safetensors_equal": all(
            torch.equal(loaded[name], state[name]) for name in state
        ),
    }


def results_series(histories: dict[str, dict]) -> dict[str, dict[str, list[float]]]:
    """Each run's history as two series of a results file: steps and epochs."""
    series = {}
    for name, history in histories.items():
        steps = range(1, len(history["step_loss"]) + 1)
        epochs = range(1, len(history["epoch_accuracy"]) + 1)
        series[f"{name}.steps"] = {
            "step": [float(step) for step in steps],
            "loss": history["step_loss"],
        }
        series[f"{name}.epochs"] = {
            "epoch": [float(epoch) for epoch in epochs],
            "accuracy": history["epoch_accuracy"],
            "test_loss": history["epoch_test_loss"],
            "seconds": history["epoch_seconds"],
        }
    return series


def run_drills(
    data: MnistTensors, sizes: LabSizes, profile: Profile
) -> tuple[dict[str, float], dict[str, dict[str, list[float]]]]:
    """The drills at ``sizes``: every number (metrics) and each run's history."""
    model, adamw = lab_run(data, sizes, profile)
    histories = {
        "adamw": adamw,
        "sgd": lab_run(data, sizes, profile, "sgd")[1],
        "accumulated": lab_run(data, sizes, profile, accum_steps=sizes.accum_steps)[1],
        "bf16": lab_run(data, sizes, profile, precision="bf16")[1],
    }
    metrics = {
        "drill1.accuracy": adamw["epoch_accuracy"][-1],
        "drill1.train_seconds": sum(adamw["epoch_seconds"]),
    }
    drills = {
        "drill2": compile_timing(data, sizes, profile),
        "drill4": accumulation_agreement(data, sizes, profile),
    }
    with tempfile.TemporaryDirectory(prefix="lab-") as folder:
        drills["drill6"] = save_and_reload(model, data, sizes, Path(folder))
    for drill, values in drills.items():
        metrics |= {f"{drill}.{key}": float(value) for key, value in values.items()}
    images, labels = data.test_images, data.test_labels
    fp32_loss = accuracy_and_loss(model, images, labels)[1]
    bf16_loss = accuracy_and_loss(model, images, labels, "bf16")[1]
    metrics |= {
        "drill5.same_weights_fp32_loss": fp32_loss,
        "drill5.same_weights_bf16_loss": bf16_loss,
        "drill5.same_weights_relative_difference": abs(bf16_loss - fp32_loss)
        / fp32_loss,
    }
    for name in ("sgd", "accumulated", "bf16"):
        metrics[f"{name}.accuracy"] = histories[name]["epoch_accuracy"][-1]
    return metrics, results_series(histories)
