"""Checkers for the exercise notebook ``pytorch_drills.ipynb``: one ``check_drill_N`` per drill.

Each checker recomputes what it can from the objects you pass (your model,
your file, your numbers) and raises ``DrillCheckError`` listing everything that
is wrong: accuracy below target, parameters that never moved, a state dict that
did not round-trip. When all is well it returns a one-line summary.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import Tensor, nn

TARGET_ACCURACY = 0.97
MAX_EPOCHS = 3
# Drill 4: weights after the same steps. Float32 sums of 4 x 32 and of 128 examples
# round differently (about 1e-7 relative per step); 2e-6 leaves room for a few dozen
# steps and is far below what a wrong data order or a missing zero_grad gives.
ACCUMULATION_WEIGHT_ATOL = 2e-6
MAX_ACCURACY_GAP = 0.005  # drill 4: "unchanged" accuracy, half a percentage point
MAX_AUTOCAST_LOSS_GAP = 0.005  # drill 5: the lab's 0.5%
# Drill 5: your losses against the checker's recomputation. 2e-5 relative covers a
# different evaluation batching; bf16 autocast moves the loss about ten times more.
LOSS_RECOMPUTE_RTOL = 2e-5
COMPILED_LOGIT_ATOL = 1e-4  # drill 2: compiled kernels fuse and reorder float32 sums
SAFETENSORS_HEADER_LENGTH_BYTES = 8


class DrillCheckError(AssertionError):
    """A drill's answer is wrong; the message lists every problem found."""


def _fail_if(problems: list[str], drill: int) -> None:
    if problems:
        raise DrillCheckError(f"drill {drill}: " + "; ".join(problems))


@torch.no_grad()
def _logits(model: nn.Module, images: Tensor, autocast_dtype: torch.dtype | None = None) -> Tensor:
    was_training = model.training
    model.eval()
    with torch.autocast(images.device.type, dtype=autocast_dtype or torch.float32,
                        enabled=autocast_dtype is not None):
        logits = model(images).float()
    model.train(was_training)
    return logits


def check_drill_1(model: nn.Module, initial_state: Mapping[str, Tensor], test_images: Tensor,
                  test_labels: Tensor, epochs: int) -> str:
    """At most 3 epochs, every parameter moved from ``initial_state``, test accuracy >= 97%."""
    problems = []
    if epochs > MAX_EPOCHS:
        problems.append(f"trained {epochs} epochs; the drill allows at most {MAX_EPOCHS}")
    current = model.state_dict()
    frozen = [name for name, tensor in initial_state.items()
              if name in current and torch.equal(current[name].cpu(), tensor.cpu())]
    if frozen:
        problems.append(f"parameters not moving from their initial values: {frozen} "
                        "(is optimizer.step() called, on this model's parameters?)")
    accuracy = (_logits(model, test_images).argmax(dim=1) == test_labels).float().mean().item()
    if accuracy < TARGET_ACCURACY:
        problems.append(f"test accuracy {accuracy:.2%} is below the {TARGET_ACCURACY:.0%} target")
    _fail_if(problems, 1)
    return f"drill 1 passed: {accuracy:.2%} test accuracy in {epochs} epochs"


def check_drill_2(compiled_model: nn.Module, sample: Tensor, compile_s: float, eager_epoch_s: float,
                  compiled_epoch_s: float) -> str:
    """A ``torch.compile``d model that computes what its eager module does, and three positive timings."""
    problems = []
    eager = getattr(compiled_model, "_orig_mod", None)
    if eager is None:
        problems.append(f"{type(compiled_model).__name__} is not the result of torch.compile(model)")
    else:
        difference = (compiled_model(sample) - eager(sample)).abs().max().item()
        if difference > COMPILED_LOGIT_ATOL:
            problems.append(f"compiled and eager logits differ by {difference:.2e} (> {COMPILED_LOGIT_ATOL})")
    for name, value in [("compile_s", compile_s), ("eager_epoch_s", eager_epoch_s),
                        ("compiled_epoch_s", compiled_epoch_s)]:
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            problems.append(f"{name} = {value!r}; expected a positive number of seconds")
    _fail_if(problems, 2)
    return (f"drill 2 passed: compile {compile_s:.1f} s; epoch {eager_epoch_s:.2f} s eager, "
            f"{compiled_epoch_s:.2f} s compiled")


def check_drill_3(optimizer: torch.optim.Optimizer, sgd_losses: Sequence[float],
                  adamw_losses: Sequence[float]) -> str:
    """SGD with momentum 0.9, a loss curve as long as AdamW's (one step axis), and a loss that fell."""
    problems = []
    if not isinstance(optimizer, torch.optim.SGD):
        problems.append(f"the optimizer is {type(optimizer).__name__}, not torch.optim.SGD")
    elif any(group["momentum"] != 0.9 for group in optimizer.param_groups):
        problems.append(f"momentum is {optimizer.param_groups[0]['momentum']}, expected 0.9")
    if len(sgd_losses) != len(adamw_losses):
        problems.append(f"{len(sgd_losses)} SGD losses against {len(adamw_losses)} AdamW losses: "
                        "train the same number of steps so the curves share a step axis")
    window = max(1, len(sgd_losses) // 10)
    if len(sgd_losses) and not sum(sgd_losses[-window:]) < sum(sgd_losses[:window]):
        problems.append("SGD's loss did not fall from the first tenth of training to the last")
    _fail_if(problems, 3)
    return f"drill 3 passed: SGD loss {sum(sgd_losses[:window]) / window:.3f} -> {sum(sgd_losses[-window:]) / window:.3f}"


def check_drill_4(big_batch_state: Mapping[str, Tensor], accumulated_state: Mapping[str, Tensor],
                  big_batch_accuracy: float, accumulated_accuracy: float) -> str:
    """Weights after the same steps agree to float tolerance; final accuracies within half a point."""
    problems = []
    if big_batch_state.keys() != accumulated_state.keys():
        problems.append("the two state dicts have different keys")
    else:
        difference = max((big_batch_state[name] - accumulated_state[name]).abs().max().item()
                         for name in big_batch_state)
        if difference > ACCUMULATION_WEIGHT_ATOL:
            problems.append(f"weights differ by up to {difference:.2e} (> {ACCUMULATION_WEIGHT_ATOL:.0e}): "
                            "same initial weights, same data order, each micro-batch loss divided by "
                            "the whole batch's size, one step per accum_steps micro-batches?")
    gap = abs(big_batch_accuracy - accumulated_accuracy)
    if gap > MAX_ACCURACY_GAP:
        problems.append(f"accuracies differ by {gap:.2%} (> {MAX_ACCURACY_GAP:.1%})")
    _fail_if(problems, 4)
    return f"drill 4 passed: accuracy {big_batch_accuracy:.2%} vs {accumulated_accuracy:.2%} accumulated"


def check_drill_5(model: nn.Module, test_images: Tensor, test_labels: Tensor, fp32_loss: float,
                  bf16_loss: float) -> str:
    """Your two test losses of the same weights are the fp32 and the bf16-autocast ones, within 0.5%."""
    problems = []
    expected_fp32 = F.cross_entropy(_logits(model, test_images), test_labels).item()
    expected_bf16 = F.cross_entropy(_logits(model, test_images, torch.bfloat16), test_labels).item()
    for name, value, expected in [("fp32_loss", fp32_loss, expected_fp32), ("bf16_loss", bf16_loss, expected_bf16)]:
        if not math.isclose(value, expected, rel_tol=LOSS_RECOMPUTE_RTOL):
            problems.append(f"{name} = {value:.6f}, but the checker computes {expected:.6f} for this model")
    if fp32_loss == bf16_loss:
        problems.append("the two losses are identical: was autocast enabled, with dtype=torch.bfloat16?")
    gap = abs(bf16_loss - fp32_loss) / fp32_loss
    if gap >= MAX_AUTOCAST_LOSS_GAP:
        problems.append(f"bf16 loss differs from fp32 by {gap:.2%} (>= {MAX_AUTOCAST_LOSS_GAP:.1%})")
    _fail_if(problems, 5)
    return f"drill 5 passed: same weights, loss {fp32_loss:.5f} fp32 vs {bf16_loss:.5f} bf16 ({gap:.3%})"


def check_drill_6(model: nn.Module, reloaded: nn.Module, test_images: Tensor) -> str:
    """A separate model, loaded from the file, whose test logits equal the original's bit for bit."""
    problems = []
    if reloaded is model:
        problems.append("`reloaded` is the original model object; build a new model and load the file into it")
    shared = {p.data_ptr() for p in model.parameters()} & {p.data_ptr() for p in reloaded.parameters()}
    if shared and reloaded is not model:
        problems.append("the reloaded model shares parameter memory with the original")
    before, after = _logits(model, test_images), _logits(reloaded, test_images)
    if not torch.equal(before, after):
        problems.append(f"test logits differ (max {(before - after).abs().max().item():.2e}): "
                        "the state dict did not round-trip")
    _fail_if(problems, 6)
    return f"drill 6 passed: {before.numel():,} test logits bit-identical after reloading"


def check_drill_7(path: Path | str, model: nn.Module) -> str:
    """A safetensors file (8-byte length, JSON header) holding exactly the model's state dict."""
    path = Path(path)
    problems = []
    data = path.read_bytes()
    length = int.from_bytes(data[:SAFETENSORS_HEADER_LENGTH_BYTES], "little")
    try:
        header = json.loads(data[SAFETENSORS_HEADER_LENGTH_BYTES: SAFETENSORS_HEADER_LENGTH_BYTES + length])
    except (ValueError, UnicodeDecodeError):
        _fail_if([f"{path} is not a safetensors file: its first 8 bytes announce a {length:,}-byte "
                  f"header that is not JSON (starts with {data[:4]!r})"], 7)
    loaded = safetensors.torch.load_file(path)
    state = model.state_dict()
    if loaded.keys() != state.keys():
        problems.append(f"{path} holds {sorted(loaded)}, the model has {sorted(state)}")
    else:
        unequal = [name for name in state if not torch.equal(loaded[name], state[name].cpu())]
        if unequal:
            problems.append(f"{path}: tensors differ from the model's: {unequal}")
    _fail_if(problems, 7)
    tensors = len([key for key in header if key != "__metadata__"])
    return f"drill 7 passed: {path.name} has {tensors} tensors, all equal to the model's"
