"""Save and load model weights and the full training state, safely and exactly.

Two kinds of file serve two purposes:

- **Weights** (``save_weights`` / ``load_weights``, and ``save_safetensors`` /
  ``load_safetensors`` to publish): the model's ``state_dict`` and nothing else.
  This is what you hand to someone who will run or fine-tune the model.
- **Training checkpoints** (``save_training_checkpoint`` /
  ``load_training_checkpoint``): everything a run needs to continue as if it had
  never stopped: model, optimizer, learning-rate scheduler, ``GradScaler``, step
  (and the fp16 steps the scaler skipped), random-number-generator states
  (Python, NumPy, torch CPU and CUDA), the data stream's position, the loss
  history and both configurations.

Rules every function here keeps:

- **Files load with ``torch.load(..., weights_only=True)``**: they hold only
  tensors and plain values (numbers, strings, lists, tuples, dicts), so loading
  never runs code from the file. Saving refuses anything else, naming the key.
- **Writes are atomic**: a temporary file in the same folder, ``fsync``, rename
  over the final name, ``fsync`` of the folder. A crash during a save leaves the
  previous file whole; the half-written temporary never has a checkpoint's name.
- **Errors name the file and the problem, and are raised before anything is
  copied into the model**, so a refused load never leaves a half-loaded model.

This module imports neither the training loop nor the data pipeline: it takes
the objects (model, optimizer, ...) and the data position as a plain dict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch
from torch import nn

# Written into every training checkpoint so a file of another kind is recognised.
TRAINING_FORMAT = "torchbook.training_checkpoint"
TRAINING_FORMAT_VERSION = 1
# Training checkpoints are named step_00000042.pt, so sorting names sorts steps.
CHECKPOINT_PATTERN = re.compile(r"^step_(\d{8})\.pt$")
# A save in progress writes ".<final name>.tmp-<pid>"; it never matches CHECKPOINT_PATTERN.
TEMPORARY_MARKER = ".tmp-"
# Prefixes that wrappers add to every key: torch.compile's OptimizedModule and DDP.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")
# safetensors metadata key (and index metadata key) recording tied tensors.
ALIASES_KEY = "torchbook.aliases"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SNIFF_BYTES = 16
LISTED_KEYS = 12  # an error lists at most this many missing or unexpected keys


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read as asked; the message names the file and the problem."""


# --------------------------------------------------------------------------- atomic writes


def _fsync_path(path: Path) -> None:
    """Flush a file's (or folder's) data and metadata to the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def temporary_path(path: Path) -> Path:
    """Where a save of ``path`` writes first: hidden, same folder (so the rename is atomic)."""
    return path.parent / f".{path.name}{TEMPORARY_MARKER}{os.getpid()}"


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Write a file so that a crash at any moment leaves either the old file or the new one, whole.

    ``write(temporary)`` writes the content to a temporary path in the same
    folder; then the temporary is fsync'd (its bytes are on the disk), renamed
    over ``path`` (``os.replace`` is atomic within a file system) and the
    folder is fsync'd (the rename itself is on the disk).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(path)
    try:
        write(temporary)
        _fsync_path(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_path(path.parent)
    return path


# --------------------------------------------------------------------------- reading files


def file_kind(path: str | Path) -> str:
    """Guess what a file is from its first bytes: "torch", "torch-legacy", "safetensors", "empty" or "unknown".

    ``torch.save`` writes a zip archive (starts with ``PK``); before PyTorch 1.6
    it wrote a bare pickle (starts with protocol byte 0x80). A safetensors file
    starts with an 8-byte little-endian header length followed by ``{``.
    """
    with open(path, "rb") as handle:
        head = handle.read(SNIFF_BYTES)
    if not head:
        return "empty"
    if head.startswith(b"PK\x03\x04"):
        return "torch"
    if head[:1] == b"\x80":
        return "torch-legacy"
    if len(head) > 8 and head[8:9] == b"{":
        return "safetensors"
    return "unknown"


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")


def read_torch_file(path: str | Path, *, mmap: bool = False) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``, with errors that name the file and the problem.

    ``weights_only=True`` only rebuilds tensors and plain values, so a file that
    would run code (a pickled object whose ``__reduce__`` calls a function) is
    refused instead of executed. ``mmap=True`` maps the tensors' bytes from the
    file instead of reading them: loading is immediate and the pages are read
    when the tensors are first used.
    """
    path = Path(path)
    _require_file(path)
    kind = file_kind(path)
    if kind == "empty":
        raise CheckpointError(f"{path}: the file is empty (0 bytes); was the save interrupted?")
    if kind == "safetensors":
        raise CheckpointError(
            f"{path}: is a safetensors file, not a torch.save file; read it with load_safetensors()"
        )
    if kind == "unknown":
        with open(path, "rb") as handle:
            head = handle.read(SNIFF_BYTES)
        raise CheckpointError(
            f"{path}: not a file written by torch.save (it starts with {head!r}; "
            "expected a zip archive starting with b'PK\\x03\\x04')"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # torch raises RuntimeError, UnpicklingError, KeyError... by case
        text = str(error).strip()
        # torch's first sentence says what failed; the rest is general advice
        message = text.splitlines()[0].split(". ")[0] if text else type(error).__name__
        if "central directory" in message or "zip archive" in message:
            raise CheckpointError(
                f"{path}: truncated or corrupt torch.save archive ({os.path.getsize(path):,} bytes; "
                f"{message}); was the write interrupted?"
            ) from error
        if "Weights only load failed" in text:
            detail = next((line.strip().split(". ")[0] for line in text.splitlines()
                           if "unsupported" in line.lower() and "global" in line.lower()), message)
            raise CheckpointError(
                f"{path}: refused by torch.load(weights_only=True): {detail}. The file holds "
                "objects other than tensors and plain values, and rebuilding them could run code; "
                "only load it with weights_only=False if you made the file yourself."
            ) from error
        raise CheckpointError(f"{path}: torch.load failed: {type(error).__name__}: {message}") from error


# --------------------------------------------------------------------------- weights


def unwrap_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the key prefix that a wrapper adds: ``_orig_mod.`` (torch.compile) or ``module.`` (DDP).

    A compiled or DDP-wrapped model saves every key with its wrapper's prefix,
    and the plain model that loads the file later knows none of them. A prefix
    is removed only when every key carries it, so a model that merely has a
    submodule called ``module`` keeps its names.
    """
    unwrapped = dict(state_dict)
    stripped = True
    while stripped and unwrapped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if all(key.startswith(prefix) for key in unwrapped):
                unwrapped = {key[len(prefix):]: value for key, value in unwrapped.items()}
                stripped = True
    return unwrapped


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside a torch.compile (``_orig_mod``) or DDP (``.module``) wrapper."""
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def _first_few(keys: list[str]) -> str:
    """The keys, or the first LISTED_KEYS of them and how many more (an LLM has hundreds)."""
    shown = ", ".join(keys[:LISTED_KEYS])
    return shown if len(keys) <= LISTED_KEYS else f"{shown} and {len(keys) - LISTED_KEYS} more"


def state_dict_problems(model: nn.Module, state_dict: Mapping[str, Any]) -> list[str]:
    """Every way ``state_dict`` does not fit ``model``: missing and unexpected keys, shapes, dtypes.

    Empty when ``model.load_state_dict(state_dict, strict=True)`` would copy every
    tensor unchanged. ``load_state_dict`` itself copies the keys that fit and
    raises only at the end, leaving a half-loaded model; checking first avoids that.
    """
    expected = unwrap_model(model).state_dict()
    problems = []
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    if missing:
        problems.append(f"{len(missing)} missing keys (in the model, not in the file): {_first_few(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys (in the file, not in the model): {_first_few(unexpected)}")
    for key, target in expected.items():
        source = state_dict.get(key)
        if not isinstance(source, torch.Tensor):
            if key in state_dict:
                problems.append(f"{key}: file has a {type(source).__name__}, expected a tensor")
            continue
        if source.shape != target.shape:
            problems.append(f"{key}: shape {tuple(source.shape)} in the file, {tuple(target.shape)} in the model")
        elif source.dtype != target.dtype:
            problems.append(f"{key}: dtype {source.dtype} in the file, {target.dtype} in the model")
    return problems


def check_state_dict(model: nn.Module, state_dict: Mapping[str, Any], source: str | Path) -> None:
    """Raise CheckpointError naming ``source`` and listing every problem, unless ``state_dict`` fits ``model``."""
    problems = state_dict_problems(model, state_dict)
    if problems:
        listing = "\n  ".join(problems)
        raise CheckpointError(
            f"{source}: does not fit {type(unwrap_model(model)).__name__} "
            f"(architecture mismatch); nothing was loaded:\n  {listing}"
        )


def save_weights(model: nn.Module, path: str | Path) -> Path:
    """Save the model's ``state_dict`` (wrapper prefixes removed) atomically with ``torch.save``."""
    state_dict = unwrap_state_dict(model.state_dict())
    return atomic_write(path, lambda temporary: torch.save(state_dict, temporary))


def load_weights(model: nn.Module, path: str | Path, *, mmap: bool = False) -> nn.Module:
    """Load weights saved by ``save_weights`` (or any ``torch.save(state_dict)``) into ``model``.

    Keys, shapes and dtypes are all checked before the first tensor is copied,
    so on any error the model is unchanged. Prefixes from torch.compile or DDP
    are removed from the file's keys, and ``model`` may itself be compiled.
    """
    path = Path(path)
    state_dict = read_torch_file(path, mmap=mmap)
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"{path}: holds a {type(state_dict).__name__}, expected a state_dict (a dict of tensors)")
    if state_dict.get("format") == TRAINING_FORMAT:
        raise CheckpointError(
            f"{path}: is a training checkpoint, not a weights file; use load_training_checkpoint(), "
            "or load_weights_from_training_checkpoint() for the model alone"
        )
    state_dict = unwrap_state_dict(state_dict)
    check_state_dict(model, state_dict, path)
    unwrap_model(model).load_state_dict(state_dict, strict=True)
    return model


# --------------------------------------------------------------------------- plain values only


_PLAIN_TYPES = (bool, int, float, str, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size)
# Exact container types: a subclass (defaultdict, a namedtuple) pickles under its own class name and is refused.
_PLAIN_MAPPINGS = (dict, OrderedDict)
_PLAIN_SEQUENCES = (list, tuple)


def plain_value_problems(value: Any, where: str = "state") -> list[str]:
    """Every value inside ``value`` that ``torch.load(weights_only=True)`` would refuse, by its key path."""
    if isinstance(value, _PLAIN_TYPES):
        return []
    if type(value) in _PLAIN_MAPPINGS:
        problems = [f"{where}: key {key!r} is a {type(key).__name__}"
                    for key in value if not isinstance(key, (str, int))]
        for key, item in value.items():
            problems += plain_value_problems(item, f"{where}[{key!r}]")
        return problems
    if type(value) in _PLAIN_SEQUENCES:
        problems = []
        for index, item in enumerate(value):
            problems += plain_value_problems(item, f"{where}[{index}]")
        return problems
    return [f"{where}: {type(value).__module__}.{type(value).__qualname__} is not a tensor or a plain value"]


def config_as_dict(config: Any) -> dict[str, Any] | None:
    """A configuration as a dict of plain values: a dataclass via ``asdict``, a mapping copied, None kept.

    A dataclass instance itself is not loadable with ``weights_only=True``
    (rebuilding it means importing and calling its class), so checkpoints store
    its fields instead.
    """
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if isinstance(config, Mapping):
        return dict(config)
    raise CheckpointError(f"configuration of type {type(config).__name__}: expected a dataclass instance or a dict")


def config_differences(saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None) -> list[str]:
    """Fields whose values differ between two configuration dicts, as readable lines."""
    saved, current = saved or {}, current or {}
    lines = []
    for key in sorted(set(saved) | set(current), key=str):
        old, new = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if old != new:
            lines.append(f"{key}: {old!r} in the checkpoint, {new!r} now")
    return lines


# --------------------------------------------------------------------------- random number generators


def capture_rng_state() -> dict[str, Any]:
    """The global random states of Python, NumPy, torch CPU and (if present) every CUDA device.

    NumPy's state is a tuple holding an ndarray, which ``weights_only=True``
    refuses; its 624 key words are stored as an int64 tensor instead.
    """
    version, python_words, gauss = random.getstate()
    algorithm, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "words": torch.tensor(python_words, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "algorithm": str(algorithm),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def cuda_rng_problem(state: Mapping[str, Any]) -> str | None:
    """Why ``state``'s CUDA RNG states cannot be restored here (one per device, so the counts must match), or None."""
    saved = len(state.get("torch_cuda") or [])
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if saved and saved != here:
        return f"rng: states for {saved} CUDA devices in the file, {here} here"
    return None


def restore_rng_state(state: Mapping[str, Any], source: str | Path = "checkpoint") -> None:
    """Set the global random states captured by ``capture_rng_state`` (all of them, or none on error)."""
    problem = cuda_rng_problem(state)
    if problem:
        raise CheckpointError(f"{source}: {problem}; the run would not continue exactly")
    python = state["python"]
    random.setstate((python["version"], tuple(python["words"].tolist()), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state((
        numpy["algorithm"], numpy["keys"].numpy().astype(np.uint32),
        numpy["position"], numpy["has_gauss"], numpy["cached_gaussian"],
    ))
    torch.set_rng_state(state["torch_cpu"])
    if state.get("torch_cuda"):
        torch.cuda.set_rng_state_all(state["torch_cuda"])


# --------------------------------------------------------------------------- training checkpoints


def checkpoint_name(step: int) -> str:
    """``step_00000042.pt``: zero-padded so names sort in step order."""
    return f"step_{step:08d}.pt"


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Complete training checkpoints in ``folder``, oldest step first (temporaries never match)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(path for path in folder.iterdir() if CHECKPOINT_PATTERN.match(path.name))


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete training checkpoint in ``folder``, or None if there is none."""
    found = list_checkpoints(folder)
    return found[-1] if found else None


def save_training_checkpoint(
    folder: str | Path,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    scaler: torch.amp.GradScaler | None = None,
    skipped_steps: int = 0,
    data_state: Mapping[str, Any] | None = None,
    model_config: Any = None,
    train_config: Any = None,
    history: Any = None,
    keep_last: int = 3,
) -> Path:
    """Write everything needed to resume exactly to ``folder/step_<step>.pt``; keep the newest ``keep_last``.

    Call it after optimizer step ``step`` has completed and before the next
    batch is drawn, with ``data_state`` saying how far the data stream has gone
    and ``history`` complete up to ``step`` (log pending losses first).
    ``skipped_steps`` counts the fp16 steps the ``GradScaler`` skipped: they
    consumed batches but are not in ``step``. Everything is checked for
    ``weights_only`` loadability before any byte is written, and older
    checkpoints are deleted only after the new one is durable.
    """
    if keep_last < 1:
        raise CheckpointError(f"keep_last={keep_last}: must be at least 1, or the new checkpoint would be deleted")
    folder = Path(folder)
    state = {
        "format": TRAINING_FORMAT,
        "format_version": TRAINING_FORMAT_VERSION,
        "step": int(step),
        "skipped_steps": int(skipped_steps),
        "model": unwrap_state_dict(model.state_dict()),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": capture_rng_state(),
        "data": dict(data_state) if data_state is not None else None,
        "model_config": config_as_dict(model_config),
        "train_config": config_as_dict(train_config),
        "history": history,
    }
    problems = plain_value_problems(state)
    if problems:
        raise CheckpointError(
            f"{folder / checkpoint_name(step)}: not saved; torch.load(weights_only=True) could not read it back:\n  "
            + "\n  ".join(problems)
        )
    path = atomic_write(folder / checkpoint_name(step), lambda temporary: torch.save(state, temporary))
    for old in list_checkpoints(folder)[:-keep_last]:
        old.unlink()
    for leftover in folder.glob(f".step_*{TEMPORARY_MARKER}*"):
        if not leftover.name.endswith(f"{TEMPORARY_MARKER}{os.getpid()}"):
            leftover.unlink(missing_ok=True)  # left by a save that crashed; never a checkpoint
    return path


@dataclass
class Resumed:
    """What ``load_training_checkpoint`` restored that the training loop itself must use."""

    path: Path
    step: int  # the number of optimizer steps already taken
    skipped_steps: int  # fp16 steps the scaler skipped (not counted in step)
    data_state: dict[str, Any] | None  # pass to the data stream's load_state_dict
    history: Any  # whatever was saved as history (e.g. the loss per step)
    train_config_changes: list[str] = field(default_factory=list)  # reported, not refused


def _optimizer_problems(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> list[str]:
    """Ways a saved optimizer state does not fit ``optimizer`` (group and parameter counts, state shapes)."""
    groups = saved.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups):
        return [f"optimizer: {len(groups)} parameter groups in the file, {len(optimizer.param_groups)} now"]
    problems = []
    parameters = {}
    for number, (old, new) in enumerate(zip(groups, optimizer.param_groups)):
        if len(old["params"]) != len(new["params"]):
            problems.append(
                f"optimizer group {number}: {len(old['params'])} parameters in the file, {len(new['params'])} now"
            )
        parameters.update(zip(old["params"], new["params"]))
    for index, entries in saved.get("state", {}).items():
        parameter = parameters.get(index)
        for name, value in entries.items():
            if parameter is not None and isinstance(value, torch.Tensor) and value.dim() > 0 \
                    and value.shape != parameter.shape:
                problems.append(
                    f"optimizer state {name} of parameter {index}: shape {tuple(value.shape)}, "
                    f"parameter has {tuple(parameter.shape)}"
                )
    return problems


def read_training_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a training checkpoint's dict (weights_only), refusing files of any other kind."""
    path = Path(path)
    state = read_torch_file(path)
    if not isinstance(state, Mapping) or state.get("format") != TRAINING_FORMAT:
        found = "a weights file (a state_dict)" if isinstance(state, Mapping) else f"a {type(state).__name__}"
        raise CheckpointError(f"{path}: is {found}, not a training checkpoint (no format {TRAINING_FORMAT!r})")
    if state.get("format_version") != TRAINING_FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: training checkpoint format version {state.get('format_version')}, "
            f"this code reads version {TRAINING_FORMAT_VERSION}"
        )
    return dict(state)


def load_training_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    scaler: torch.amp.GradScaler | None = None,
    model_config: Any = None,
    train_config: Any = None,
    restore_rng: bool = True,
) -> Resumed:
    """Restore a run from ``path`` into the given objects; return the step, data position and history.

    Everything is checked first, so on any error nothing has been loaded:
    the file's kind, the model configuration (a different one is refused: the
    weights would not mean the same thing), keys/shapes/dtypes of the weights,
    the optimizer's groups, and the scheduler and scaler. A different training
    configuration (say a new learning rate) is allowed and reported in
    ``Resumed.train_config_changes``: the run continues, but not exactly.
    """
    path = Path(path)
    state = read_training_checkpoint(path)
    if model_config is not None:
        changes = config_differences(state["model_config"], config_as_dict(model_config))
        if changes:
            raise CheckpointError(
                f"{path}: was saved for a different model configuration; nothing was loaded:\n  "
                + "\n  ".join(changes)
            )
    problems = state_dict_problems(model, state["model"])
    problems += _optimizer_problems(optimizer, state["optimizer"])
    for name, target in (("scheduler", scheduler), ("scaler", scaler)):
        if target is not None and state[name] is None:
            problems.append(f"{name}: none in the file, but one was passed to restore")
        if target is None and state[name] is not None:
            problems.append(f"{name}: the file has one; pass the {name} to restore it")
    if scaler is not None and state["scaler"] is not None and scaler.is_enabled() != bool(state["scaler"]):
        problems.append(
            f"scaler: {'enabled' if state['scaler'] else 'disabled'} in the file, "
            f"{'enabled' if scaler.is_enabled() else 'disabled'} now"
        )
    rng_problem = cuda_rng_problem(state["rng"]) if restore_rng else None
    if rng_problem:
        problems.append(f"{rng_problem} (pass restore_rng=False to continue, not exactly)")
    if problems:
        raise CheckpointError(
            f"{path}: does not fit the objects it should restore; nothing was loaded:\n  " + "\n  ".join(problems)
        )
    unwrap_model(model).load_state_dict(state["model"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    if restore_rng:
        restore_rng_state(state["rng"], path)
    return Resumed(
        path=path,
        step=state["step"],
        skipped_steps=state["skipped_steps"],
        data_state=state["data"],
        history=state["history"],
        train_config_changes=config_differences(state["train_config"], config_as_dict(train_config))
        if train_config is not None else [],
    )


def load_weights_from_training_checkpoint(model: nn.Module, path: str | Path) -> nn.Module:
    """Load only the model weights from a training checkpoint (to evaluate or publish it)."""
    path = Path(path)
    state = read_training_checkpoint(path)
    check_state_dict(model, state["model"], path)
    unwrap_model(model).load_state_dict(state["model"], strict=True)
    return model


# --------------------------------------------------------------------------- safetensors


def _storage_key(tensor: torch.Tensor) -> tuple:
    """Identifies a tensor's exact view of memory: tensors with equal keys are the same values."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype)


def split_aliases(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep one name per shared tensor; return the tensors to write and ``{dropped name: kept name}``.

    A tied embedding and output head appear in ``state_dict`` under two names
    for one tensor. ``torch.save`` keeps the sharing; safetensors stores each
    name's bytes separately and refuses shared memory, so one name is written
    and the other recorded as an alias in the file's metadata.
    """
    kept: dict[tuple, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    storages: dict[int, str] = {}
    for name, tensor in state_dict.items():
        key = _storage_key(tensor)
        if key in kept:
            aliases[name] = kept[key]
            continue
        pointer = tensor.untyped_storage().data_ptr()
        if tensor.numel() and pointer in storages:
            raise CheckpointError(
                f"{name}: shares memory with {storages[pointer]} but is a different view of it; "
                "safetensors cannot store overlapping tensors (clone one of them first)"
            )
        if tensor.numel():
            storages[pointer] = name
        kept[key] = name
        tensors[name] = tensor.detach().contiguous()
    return tensors, aliases


def _tensors_to_publish(model_or_state_dict: nn.Module | Mapping[str, torch.Tensor]
                        ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to write, without wrapper prefixes and each shared tensor once, and the aliases dropped."""
    state_dict = (model_or_state_dict.state_dict() if isinstance(model_or_state_dict, nn.Module)
                  else model_or_state_dict)
    return split_aliases(unwrap_state_dict(state_dict))


def save_safetensors(model_or_state_dict: nn.Module | Mapping[str, torch.Tensor], path: str | Path,
                     metadata: Mapping[str, str] | None = None) -> Path:
    """Export weights to one safetensors file, atomically, with tied tensors stored once."""
    tensors, aliases = _tensors_to_publish(model_or_state_dict)
    header = {str(key): str(value) for key, value in (metadata or {}).items()}
    header[ALIASES_KEY] = json.dumps(aliases)
    return atomic_write(path, lambda temporary: safetensors.torch.save_file(tensors, temporary, metadata=header))


def read_safetensors(path: str | Path, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Read a safetensors file into a state_dict, with aliased names pointing at the same tensor again."""
    path = Path(path)
    _require_file(path)
    if file_kind(path) != "safetensors":
        raise CheckpointError(f"{path}: not a safetensors file (it looks like: {file_kind(path)})")
    try:
        with safetensors.safe_open(path, framework="pt", device=device) as handle:
            metadata = handle.metadata() or {}
            state_dict = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as error:  # SafetensorError is not exported under a stable name
        raise CheckpointError(f"{path}: unreadable safetensors file ({error}); was the write interrupted?") from error
    for alias, kept in json.loads(metadata.get(ALIASES_KEY, "{}")).items():
        state_dict[alias] = state_dict[kept]
    return state_dict


def load_safetensors(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a safetensors file (one file, or a sharded folder with its index) into ``model``, checked first."""
    path = Path(path)
    state_dict = read_sharded_safetensors(path) if path.is_dir() or path.suffix == ".json" else read_safetensors(path)
    check_state_dict(model, state_dict, path)
    unwrap_model(model).load_state_dict(state_dict, strict=True)
    return model


def save_sharded_safetensors(model_or_state_dict: nn.Module | Mapping[str, torch.Tensor], folder: str | Path,
                             max_shard_bytes: int) -> Path:
    """Split weights into ``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json``.

    This is the Hugging Face hub layout: the index's ``weight_map`` says which
    file holds each tensor, so a loader can open only the shards it needs. Each
    shard holds whole tensors, so one larger than ``max_shard_bytes`` gets a shard
    of its own. The index is written last: until it exists, no shard set is complete.
    """
    tensors, aliases = _tensors_to_publish(model_or_state_dict)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    folder = Path(folder)
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        atomic_write(folder / filename,
                     lambda temporary, shard=shard: safetensors.torch.save_file(shard, temporary, metadata={}))
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    index = {"metadata": {"total_size": total, ALIASES_KEY: aliases}, "weight_map": weight_map}
    return atomic_write(folder / SAFETENSORS_INDEX,
                        lambda temporary: temporary.write_text(json.dumps(index, indent=2)))


def read_sharded_safetensors(folder_or_index: str | Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Read the tensors listed in a sharded checkpoint's index (all, or only ``names``), one shard at a time."""
    index_path = Path(folder_or_index)
    if index_path.is_dir():
        index_path = index_path / SAFETENSORS_INDEX
    _require_file(index_path)
    try:
        index = json.loads(index_path.read_text())
        weight_map: dict[str, str] = index["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{index_path}: not a safetensors index (expected JSON with a 'weight_map')") from error
    aliases: dict[str, str] = index.get("metadata", {}).get(ALIASES_KEY, {})
    wanted = list(weight_map) + list(aliases) if names is None else list(names)
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        stored = aliases.get(name, name)
        if stored not in weight_map:
            raise CheckpointError(f"{index_path}: no tensor named {name!r} in the weight_map")
        by_file.setdefault(weight_map[stored], []).append(stored)
    state_dict: dict[str, torch.Tensor] = {}
    for filename, stored_names in by_file.items():
        shard = index_path.parent / filename
        _require_file(shard)
        try:
            with safetensors.safe_open(shard, framework="pt", device="cpu") as handle:
                for name in stored_names:
                    state_dict[name] = handle.get_tensor(name)
        except Exception as error:
            raise CheckpointError(f"{shard}: unreadable safetensors shard ({error})") from error
    for name in wanted:
        if name in aliases:
            state_dict[name] = state_dict[aliases[name]]
    return {name: state_dict[name] for name in wanted}


# --------------------------------------------------------------------------- big models: meta device


def _tied_parameter_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one Parameter object (tied weights), from the model's structure."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _set_parameter(model: nn.Module, name: str, parameter: nn.Parameter) -> None:
    owner_name, _, attribute = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    setattr(owner, attribute, parameter)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While active, every parameter a module registers is moved to the meta device; buffers stay real.

    ``with torch.device("meta")`` puts *everything* built inside on meta,
    including buffers that ``state_dict`` does not hold (``persistent=False``:
    causal masks, RoPE tables); after loading they would still be meta, with no
    values. Parameters are the big part and the checkpoint supplies them; buffers
    are small and computed by the constructor, so only parameters go to meta.
    This is what Hugging Face Accelerate's ``init_empty_weights()`` does, and
    like it this patches ``nn.Module.register_parameter`` for the duration of
    the block, so build one model at a time, from one thread. (torchtitan
    instead builds under ``torch.device("meta")`` and calls a model method that
    recomputes the buffers; that needs the model's cooperation, this does not.)
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, parameter: nn.Parameter | None) -> None:
        if parameter is not None and not parameter.is_meta:
            parameter = nn.Parameter(parameter.to("meta"), requires_grad=parameter.requires_grad)
        register(module, name, parameter)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def load_on_meta(build: Callable[[], nn.Module], state_dict: Mapping[str, torch.Tensor],
                 source: str | Path) -> nn.Module:
    """Build a model without initialising its weights, then adopt the checkpoint's tensors as its parameters.

    Parameters are created on the meta device (shapes, no memory), so no random
    initialisation is computed and then thrown away, and memory holds one copy
    of the weights instead of two. ``load_state_dict(..., assign=True)`` makes
    the loaded tensors the parameters (loaded with ``mmap=True`` they stay in the
    file's pages until used). Tied weights are tied again afterwards, since
    assignment gives each name its own Parameter.
    """
    with parameters_on_meta():
        model = build()
    ties = _tied_parameter_names(model)
    check_state_dict(model, state_dict, source)
    model.load_state_dict(state_dict, assign=True, strict=True)
    for names in ties:
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            _set_parameter(model, name, shared)
    still_meta = meta_tensors(model)
    if still_meta:
        raise CheckpointError(
            f"{source}: after loading, {still_meta} are still on the meta device, with no values "
            "(buffers that state_dict does not save); build with parameters_on_meta() so they are computed"
        )
    return model


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of the parameters and buffers of ``model`` that are on the meta device (have no values)."""
    return [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
