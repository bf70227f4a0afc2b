"""Checkers for drills 5 to 7 of the exercise notebook: drill 1's trained model.

Drill 5 evaluates the trained model in float32 and under bf16 autocast, drill 6
saves its state dict and loads it into a new model, and drill 7 writes it as
safetensors. Their checkers recompute both losses from the model, read each
file as a loader would (``torch.load`` with ``weights_only=True``, the
safetensors header by hand), and compare every tensor and logit with the
model's.

It builds on ``torchbook.book.lab`` for the evaluation.
"""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchbook.book.drills import fail_if, same_tensors
from torchbook.book.lab import eval_logits

MAX_AUTOCAST_LOSS_GAP = 0.005  # drill 5: the lab's 0.5%
# Drill 5: your losses against the checker's recomputation. 2e-5 relative covers a
# different evaluation batching; bf16 autocast moves the loss about ten times more.
LOSS_RECOMPUTE_RTOL = 2e-5
SAFETENSORS_HEADER_LENGTH_BYTES = 8


def check_drill_5(
    model: nn.Module,
    test_images: Tensor,
    test_labels: Tensor,
    fp32_loss: float,
    bf16_loss: float,
) -> str:
    """Test losses of one float32 model in fp32 and under bf16 autocast, within 0.5%."""
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        fail_if(
            [
                f"the model's weights are {sorted(map(str, dtypes))}, not float32: "
                "model.to(torch.bfloat16) rounds the weights; autocast keeps them "
                "and runs each matrix product in bf16. Reload drill 1's weights and "
                "put `with torch.autocast(device_type, dtype=torch.bfloat16):` "
                "around the forward pass"
            ],
            5,
        )
    problems = []
    for name, value, precision in [
        ("fp32_loss", fp32_loss, "fp32"),
        ("bf16_loss", bf16_loss, "bf16"),
    ]:
        logits = eval_logits(model, test_images, precision)
        expected = F.cross_entropy(logits, test_labels).item()
        if not math.isclose(value, expected, rel_tol=LOSS_RECOMPUTE_RTOL):
            problems.append(
                f"{name} = {value:.6f}, but the checker computes {expected:.6f} for "
                "this model"
            )
    if fp32_loss == bf16_loss:
        problems.append(
            "the two losses are identical: was autocast enabled, with "
            "dtype=torch.bfloat16?"
        )
    gap = abs(bf16_loss - fp32_loss) / fp32_loss
    if gap >= MAX_AUTOCAST_LOSS_GAP:
        problems.append(
            f"bf16 loss differs from fp32 by {gap:.2%} (>= {MAX_AUTOCAST_LOSS_GAP:.1%})"
        )
    fail_if(problems, 5)
    return (
        f"drill 5 passed: same weights, loss {fp32_loss:.5f} fp32 vs "
        f"{bf16_loss:.5f} bf16 ({gap:.3%})"
    )


def check_drill_6(
    model: nn.Module,
    reloaded: nn.Module,
    checkpoint_path: Path | str,
    test_images: Tensor,
) -> str:
    """A state dict file that loads ``weights_only`` into a new model, same logits."""
    path = Path(checkpoint_path)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as error:
        fail_if(
            [
                f"{path} does not load with torch.load(..., weights_only=True): "
                f"{str(error).splitlines()[0][:120]}. torch.save(model) pickles the "
                "module object, and reading it back needs weights_only=False, which "
                "runs whatever code the file names; save model.state_dict() instead"
            ],
            6,
        )
    problems = []
    state = {name: tensor.cpu() for name, tensor in model.state_dict().items()}
    if not isinstance(saved, Mapping) or saved.keys() != state.keys():
        keys = sorted(saved)[:4] if isinstance(saved, Mapping) else "-"
        problems.append(
            f"{path} holds {type(saved).__name__} with keys {keys}; expected the "
            f"model's state dict, keys {sorted(state)[:4]}..."
        )
    elif not same_tensors(saved, state):
        problems.append(f"{path} holds other weights than the model's (saved early?)")
    if reloaded is model:
        problems.append(
            "`reloaded` is the original model object; build a new model and load the "
            "file into it"
        )
    shapes = [tuple(tensor.shape) for tensor in reloaded.state_dict().values()]
    if shapes != [tuple(tensor.shape) for tensor in state.values()]:
        problems.append(
            f"the reloaded model has other parameters ({shapes}); build it with the "
            "same sizes and load_state_dict with strict=True, which refuses a mismatch"
        )
    else:
        before = eval_logits(model, test_images)
        after = eval_logits(reloaded, test_images)
        if not torch.equal(before, after):
            problems.append(
                f"test logits differ (max {(before - after).abs().max().item():.2e}): "
                "the state dict did not round-trip"
            )
    fail_if(problems, 6)
    return (
        f"drill 6 passed: {path.name} is a state dict; the reloaded model's "
        f"{len(test_images):,} predictions are bit-identical"
    )


def check_drill_7(safetensors_path: Path | str, model: nn.Module) -> str:
    """A safetensors file (8-byte length, JSON header) with exactly the state dict."""
    path = Path(safetensors_path)
    data = path.read_bytes()
    length = int.from_bytes(data[:SAFETENSORS_HEADER_LENGTH_BYTES], "little")
    header_end = SAFETENSORS_HEADER_LENGTH_BYTES + length
    try:
        header = json.loads(data[SAFETENSORS_HEADER_LENGTH_BYTES:header_end])
    except (ValueError, UnicodeDecodeError):
        fail_if(
            [
                f"{path} is not a safetensors file: its first 8 bytes announce a "
                f"{length:,}-byte header that is not JSON (starts with {data[:4]!r})"
            ],
            7,
        )
    loaded = safetensors.torch.load_file(path)
    state = model.state_dict()
    problems = []
    if loaded.keys() != state.keys():
        problems.append(f"{path} holds {sorted(loaded)}, the model has {sorted(state)}")
    else:
        unequal = [
            name for name in state if not torch.equal(loaded[name], state[name].cpu())
        ]
        if unequal:
            problems.append(f"{path}: tensors differ from the model's: {unequal}")
    fail_if(problems, 7)
    tensors = len([key for key in header if key != "__metadata__"])
    return (
        f"drill 7 passed: {path.name} has {tensors} tensors, all equal to the model's"
    )
