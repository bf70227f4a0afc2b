"""The global random generators of one process: captured, checked, restored.

A resumed run draws the same dropout masks, shuffles and samples as an
uninterrupted one only if every generator it draws from continues where
it stopped. A training process draws from four: Python's ``random``,
NumPy's global ``RandomState``, torch's CPU generator and, when it trains
on an accelerator, that device's generator. ``capture_rng_state`` takes
all four as tensors and plain values, which ``torch.load(weights_only=True)``
reads back; ``restore_rng_state`` sets them again.

**Check, then restore.** Each library refuses a malformed state in its own
way, and a restore that stopped after Python's generator would leave the
process half old, half new. ``rng_state_problems`` therefore tries each
CPU state on a private generator first, and ``rng_device_problems``
checks that the device generator saved is the one training here, so
that ``restore_rng_state`` cannot fail once they find nothing.

**What it does not cover.** Only the global generators: a generator you
create and pass around (a ``DataLoader``'s ``generator=``, a sampler's)
keeps its own state, which its owner saves. And a ``DataLoader`` without
a generator of its own draws a base seed from the *global* torch
generator each time it is iterated, even without shuffling or workers:
iterate it after the restore, or give it its own generator. One process
only: with several ranks, each rank captures and restores its own, and
the checkpoint module gathers them into one file.

It imports only torch, NumPy and the standard library: copy it into a
project as it is.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def capture_rng_state(device: torch.device | str) -> dict[str, Any]:
    """Global random states: Python, NumPy, torch's CPU, an accelerator ``device``'s.

    Only the training device's generator: a CPU run on a CUDA machine
    saves none, so its state restores on any machine. NumPy's state holds
    its 624 key words as an ndarray, which ``weights_only=True`` refuses
    (rebuilding an ndarray means calling a NumPy function the file names);
    they are stored as a list, which ``np.random.set_state`` takes back as
    it is.
    """
    device = torch.device(device)
    algorithm, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    accelerator = torch.get_device_module(device) if device.type != "cpu" else None
    return {
        "python": random.getstate(),  # (version, 625 ints, gauss): plain values already
        "numpy": [
            str(algorithm),
            keys.tolist(),
            int(position),
            int(has_gauss),
            float(cached),
        ],
        "torch_cpu": torch.get_rng_state(),
        # {"cuda": state} for a run on CUDA (that device's generator), {} on the CPU
        "torch_device": {device.type: accelerator.get_rng_state(device)}
        if accelerator
        else {},
    }


def rng_state_problems(saved: Any) -> list[str]:
    """Why ``saved`` (``capture_rng_state``'s dict) cannot be restored; empty if it can.

    Each CPU state is tried on a private generator, so each library checks
    its own format (a key missing, a wrong type, length or value) without
    touching the global ones. A device state must be a tensor; which
    device it belongs to is ``rng_device_problems``'s question.
    """
    try:
        random.Random().setstate(saved["python"])
        np.random.RandomState().set_state(tuple(saved["numpy"]))
        torch.Generator().set_state(saved["torch_cpu"])
        device_states = dict(saved["torch_device"])
    # a missing key, a wrong type, length or value: each library raises its own
    except (LookupError, TypeError, ValueError, RuntimeError) as error:
        return [f"rng: not restorable ({type(error).__name__}: {error})"]
    if not all(isinstance(state, torch.Tensor) for state in device_states.values()):
        return ["rng: a device generator's state must be a tensor"]
    return []


def rng_device_problems(
    saved: Mapping[str, Any], device: torch.device | str
) -> list[str]:
    """A problem if ``saved`` holds a device generator that ``device`` cannot take.

    A CUDA generator's state does not fit an MPS generator, and a CPU run
    has no device generator to set: restoring it would fail, or set a
    generator that the run never draws from.
    """
    kinds = sorted(saved["torch_device"])
    if kinds and kinds != [torch.device(device).type]:
        return [
            f"rng: a {kinds[0]} generator state in the file, training on {device} "
            "here; pass restore_rng=False to resume without the random states"
        ]
    return []


def restore_rng_state(saved: Mapping[str, Any], device: torch.device | str) -> None:
    """Set the global generators from ``capture_rng_state``'s dict.

    It cannot fail once ``rng_state_problems`` and ``rng_device_problems``
    find none, which is why a loader checks first and calls this last.
    """
    random.setstate(saved["python"])
    np.random.set_state(tuple(saved["numpy"]))
    torch.set_rng_state(saved["torch_cpu"])
    for kind, state in saved["torch_device"].items():
        torch.get_device_module(kind).set_rng_state(state, torch.device(device))
