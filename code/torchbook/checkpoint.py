"""Exact resume: weights and the full training state, saved atomically and refused when bad.

- **Weights** (``save_weights`` / ``load_weights``): a ``torch.save`` of the model's ``state_dict``.
  To publish weights, see ``torchbook.weights`` (safetensors).
- **Training checkpoints** (``save_training_checkpoint`` / ``load_training_checkpoint``): the
  trainer's ``state_dict()`` (model, optimizer, scheduler, scaler, step, skipped steps, history,
  losses not yet logged, config), the random generators (Python, NumPy, torch CPU, CUDA, MPS),
  the data position and the model config.

Every file loads with ``torch.load(..., weights_only=True)`` (tensors and plain values only: loading
runs no code), is written through ``torchbook.files.atomic_write`` (a crash leaves the previous file
whole), and is checked entirely before anything live changes; every error is a ``CheckpointError``
naming the file.

**Rotation keeps the newest written.** A checkpoint's name carries a save sequence beside its step
(``ckpt-000007-step-00000042.pt``); "latest" and "keep the last N" follow the sequence, never the
step or the file's time, so a run restarted from an older step keeps its new checkpoint. One process
writes to a folder at a time.

**What else exact resume depends on.** A deterministic run (same operations in the same order:
``torch.use_deterministic_algorithms(True)``, a fixed number of CPU threads, same device and
versions). A ``DataLoader`` without a ``generator`` of its own draws a base seed from the *global*
torch generator every time it is iterated, even without shuffling or workers: iterate it after
``restore_rng_state`` (or give it its own ``generator``) and restore its position from the data
state, as ``examples/resume_demo.py`` does with its ``TokenStream``.
"""

from __future__ import annotations

import dataclasses
import pickle
import random
import re
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from torchbook.files import atomic_write, is_temporary

# Written into every training checkpoint so a file of another kind is recognised.
TRAINING_FORMAT = "torchbook.training_checkpoint"
TRAINING_FORMAT_VERSION = 2
CHECKPOINT_PATTERN = re.compile(r"^ckpt-(\d{6,})-step-(\d{8,})\.pt$")
CHECKPOINT_KEYS = ("format", "format_version", "trainer", "rng", "data", "model_config")
RNG_KEYS = ("python", "numpy", "torch_cpu", "torch_cuda", "torch_mps")
# Prefixes that wrappers add to every key: torch.compile's OptimizedModule and DDP.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")
LISTED_KEYS = 12  # an error lists at most this many missing or unexpected keys


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read as asked; the message names the file and the problem."""


# --------------------------------------------------------------------------- reading torch files
def read_torch_file(path: str | Path, *, mmap: bool = False, verify: bool = True) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)`` with errors that name the file.

    The bytes are judged first: ``torch.save`` writes a zip (``PK``; before 1.6 a pickle, 0x80), safetensors
    an 8-byte length then ``{``. ``verify`` checks the zip's CRCs, which ``torch.load`` does not (one extra
    read; skip it for a huge file you trust). ``mmap=True`` maps the tensors' bytes: pages are read on use.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    with open(path, "rb") as handle:
        head = handle.read(16)
    refusal = ""
    if not head:
        refusal = "the file is empty (0 bytes); was the save interrupted?"
    elif head[8:9] == b"{" and not head.startswith(b"PK"):
        refusal = "is a safetensors file, not a torch.save file; read it with torchbook.weights.read_safetensors()"
    elif not head.startswith((b"PK\x03\x04", b"\x80")):
        refusal = f"not a file written by torch.save (it starts with {head!r}; expected a zip archive, b'PK\\x03\\x04')"
    elif head.startswith(b"PK") and not zipfile.is_zipfile(path):  # the archive's end record is missing
        refusal = f"truncated torch.save archive ({path.stat().st_size:,} bytes, no zip end record); was the write interrupted?"
    elif head.startswith(b"PK") and verify and (damage := _damaged_member(path)):
        refusal = f"corrupt torch.save file{damage}; the bytes changed after it was written"
    if refusal:
        raise CheckpointError(f"{path}: {refusal}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:  # weights_only met something other than tensors and plain values
        detail = next((line.strip() for line in str(error).splitlines() if "global" in line.lower()), _first_line(error))
        raise CheckpointError(f"{path}: refused by torch.load(weights_only=True): the file holds objects other than "
                              "tensors and plain values, and rebuilding them could run code; load it with "
                              f"weights_only=False only if you made the file yourself. (torch: {detail})") from error
    except Exception as error:  # torch raises RuntimeError, KeyError, ... depending on the damage
        raise CheckpointError(f"{path}: corrupt torch.save file{_damaged_member(path)}: "
                              f"{type(error).__name__}: {_first_line(error)}") from error


def _damaged_member(path: Path) -> str:
    """`` (member X fails its CRC)`` when the zip archive says a member's bytes changed, else ``""``."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        return f" (unreadable zip archive: {error})"
    return f" (member {bad} fails its CRC check)" if bad else ""


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


# --------------------------------------------------------------------------- weights
def unwrap_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Drop the key prefix a wrapper adds (``_orig_mod.``: torch.compile, ``module.``: DDP) when all keys have it."""
    unwrapped = dict(state_dict)
    while unwrapped and (prefix := next((p for p in WRAPPER_PREFIXES if all(
            isinstance(key, str) and key.startswith(p) for key in unwrapped)), None)):
        unwrapped = {key[len(prefix):]: value for key, value in unwrapped.items()}
    return unwrapped


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside a torch.compile (``_orig_mod``) or DDP (``.module``) wrapper."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module) or isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model._orig_mod
    return model


def state_dict_problems(model: nn.Module, state_dict: Mapping[str, Any]) -> list[str]:
    """Missing and unexpected keys, and tensors of another shape or dtype; empty when it loads unchanged.

    ``load_state_dict`` copies the keys that fit before it raises; checking first avoids a half-loaded model.
    """
    expected = unwrap_model(model).state_dict()
    problems = []
    for kind, keys in (("missing keys (in the model, not in the file)", [k for k in expected if k not in state_dict]),
                       ("unexpected keys (in the file, not in the model)", [str(k) for k in state_dict if k not in expected])):
        if keys:
            shown = ", ".join(keys[:LISTED_KEYS]) + (f" and {len(keys) - LISTED_KEYS} more" if len(keys) > LISTED_KEYS else "")
            problems.append(f"{len(keys)} {kind}: {shown}")
    for key, target in expected.items():
        source = state_dict.get(key, target)
        if not isinstance(source, torch.Tensor):
            problems.append(f"{key}: file has a {type(source).__name__}, expected a tensor")
        elif source.shape != target.shape:
            problems.append(f"{key}: shape {tuple(source.shape)} in the file, {tuple(target.shape)} in the model")
        elif source.dtype != target.dtype:
            problems.append(f"{key}: dtype {source.dtype} in the file, {target.dtype} in the model")
    return problems


def _refuse(problems: list[str], message: str) -> None:
    """If there are problems, raise CheckpointError: ``message``, then one indented line per problem."""
    if problems:
        raise CheckpointError(f"{message}:\n  " + "\n  ".join(problems))


def check_state_dict(model: nn.Module, state_dict: Mapping[str, Any], source: str | Path) -> None:
    """Raise CheckpointError naming ``source`` and every problem, unless ``state_dict`` fits ``model``."""
    _refuse(state_dict_problems(model, state_dict),
            f"{source}: does not fit {type(unwrap_model(model)).__name__} (architecture mismatch); nothing was loaded")


def _write_torch(path: Path, value: Any) -> Path:
    """``torch.save`` through ``atomic_write``; a failed write (a full disk) raises CheckpointError naming ``path``."""
    try:
        return atomic_write(path, lambda temporary: torch.save(value, temporary))
    except (OSError, RuntimeError) as error:  # torch.save reports a full disk as a RuntimeError
        raise CheckpointError(f"{path}: could not be written ({type(error).__name__}: {_first_line(error)}); "
                              "is the disk full? The previous file, if any, is unchanged") from error


def save_weights(model: nn.Module, path: str | Path) -> Path:
    """Save the model's ``state_dict`` (wrapper prefixes removed) atomically with ``torch.save``."""
    return _write_torch(Path(path), unwrap_state_dict(model.state_dict()))


def load_weights(model: nn.Module, path: str | Path, *, mmap: bool = False) -> nn.Module:
    """Load weights saved by ``save_weights`` (or any ``torch.save(state_dict)``) into ``model``, checked first."""
    path = Path(path)
    state_dict = read_torch_file(path, mmap=mmap)
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"{path}: holds a {type(state_dict).__name__}, expected a state_dict (a dict of tensors)")
    if state_dict.get("format") == TRAINING_FORMAT:
        raise CheckpointError(f"{path}: is a training checkpoint, not a weights file; use "
                              "load_training_checkpoint(), or load_weights_from_training_checkpoint()")
    state_dict = unwrap_state_dict(state_dict)
    check_state_dict(model, state_dict, path)
    unwrap_model(model).load_state_dict(state_dict, strict=True)
    return model


# --------------------------------------------------------------------------- plain values only
_PLAIN_TYPES = (bool, int, float, str, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size)


def plain_value_problems(value: Any, where: str = "state") -> list[str]:
    """Every value inside ``value`` that ``torch.load(weights_only=True)`` would refuse, by its key path.

    Containers must be exactly dict, OrderedDict, list or tuple: a subclass
    (defaultdict, a namedtuple) pickles under its own class name and is refused.
    """
    if isinstance(value, _PLAIN_TYPES):
        return []
    if type(value) in (dict, OrderedDict):
        problems = [f"{where}: key {key!r} is a {type(key).__name__}" for key in value if not isinstance(key, (str, int))]
        return problems + [p for key, item in value.items() for p in plain_value_problems(item, f"{where}[{key!r}]")]
    if type(value) in (list, tuple):
        return [p for index, item in enumerate(value) for p in plain_value_problems(item, f"{where}[{index}]")]
    return [f"{where}: {type(value).__module__}.{type(value).__qualname__} is not a tensor or a plain value"]


def config_as_dict(config: Any) -> dict[str, Any] | None:
    """A configuration as a dict of plain values (a dataclass via ``asdict``; a dataclass itself is not weights_only-loadable)."""
    if config is None or isinstance(config, Mapping):
        return None if config is None else dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    raise CheckpointError(f"configuration of type {type(config).__name__}: expected a dataclass instance or a dict")


def config_differences(saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None) -> list[str]:
    """Fields whose values differ between two configuration dicts, as readable lines (tuples equal lists)."""
    saved, current = saved or {}, current or {}
    as_list = lambda value: list(value) if isinstance(value, tuple) else value
    return [f"{key}: {saved.get(key, '<absent>')!r} in the checkpoint, {current.get(key, '<absent>')!r} now"
            for key in sorted(set(saved) | set(current), key=str)
            if as_list(saved.get(key, "<absent>")) != as_list(current.get(key, "<absent>"))]


# --------------------------------------------------------------------------- random number generators
def _mps_available() -> bool:
    return hasattr(torch, "mps") and torch.backends.mps.is_available()


def capture_rng_state() -> dict[str, Any]:
    """The global random states: Python, NumPy, torch CPU, every CUDA device and MPS (where present).

    NumPy's state holds an ndarray, which ``weights_only=True`` refuses: its 624 key words are stored as int64s.
    """
    version, python_words, gauss = random.getstate()
    algorithm, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "python": {"version": version, "words": torch.tensor(python_words, dtype=torch.int64), "gauss": gauss},
        "numpy": {"algorithm": str(algorithm), "keys": torch.from_numpy(keys.astype(np.int64)),
                  "position": int(position), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "torch_mps": torch.mps.get_rng_state() if _mps_available() else None,
    }


def _words(value: Any, count: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.int64 and tuple(value.shape) == (count,)


def _python_state(saved: Mapping[str, Any]) -> tuple:
    """The tuple ``random.setstate`` takes, checked on a private generator (which accepts any ``gauss``)."""
    gauss = saved["gauss"]
    if type(saved["version"]) is not int or not _words(saved["words"], 625) or not (gauss is None or type(gauss) is float):
        raise TypeError("expected {'version': int, 'words': 625 int64s, 'gauss': float or None}")
    state = (saved["version"], tuple(saved["words"].tolist()), gauss)
    random.Random().setstate(state)
    return state


def _numpy_state(saved: Mapping[str, Any]) -> tuple:
    """The tuple ``np.random.set_state`` takes, checked on a private generator (which accepts any position)."""
    state = (saved["algorithm"], saved["keys"], saved["position"], saved["has_gauss"], saved["cached_gaussian"])
    if state[0] != "MT19937" or not _words(state[1], 624) or type(state[2]) is not int or not 0 <= state[2] <= 624 \
            or state[3] not in (0, 1) or type(state[4]) is not float:
        raise TypeError("expected {'algorithm': 'MT19937', 'keys': 624 int64s, 'position': 0..624, "
                        "'has_gauss': 0 or 1, 'cached_gaussian': float}")
    state = (state[0], state[1].numpy().astype(np.uint32), *state[2:])
    np.random.RandomState().set_state(state)
    return state


def rng_state_problems(state: Any) -> list[str]:
    """Every reason ``state`` cannot be restored here; the global generators are not touched.

    Each field needs the type ``capture_rng_state`` wrote; each state is tried on a fresh generator of its library.
    """
    if not isinstance(state, Mapping) or any(key not in state for key in RNG_KEYS):
        return [f"rng: expected a dict with {', '.join(RNG_KEYS)}"]
    problems = []
    for name, check in (("python", _python_state), ("numpy", _numpy_state), ("torch_cpu", torch.Generator().set_state)):
        try:
            if name == "torch_cpu" and not isinstance(state[name], torch.Tensor):
                raise TypeError("expected a uint8 tensor")
            check(state[name])
        except Exception as error:  # noqa: BLE001 -- wrong type, length or value: each library raises its own
            problems.append(f"rng[{name!r}]: cannot be restored ({type(error).__name__}: {error})")
    cuda, mps = state["torch_cuda"], state["torch_mps"]
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not isinstance(cuda, list) or not all(isinstance(s, torch.Tensor) and s.dtype == torch.uint8 for s in cuda):
        problems.append("rng['torch_cuda']: expected a list of uint8 tensors")
    elif cuda and len(cuda) != here:
        problems.append(f"rng['torch_cuda']: states for {len(cuda)} CUDA devices in the file, {here} here")
    if mps is not None and not (isinstance(mps, torch.Tensor) and mps.dtype == torch.uint8):
        problems.append("rng['torch_mps']: expected a uint8 tensor or None")
    elif mps is not None and not _mps_available():
        problems.append("rng['torch_mps']: an MPS state in the file, no MPS device here")
    return problems


def restore_rng_state(state: Mapping[str, Any], source: str | Path = "checkpoint") -> None:
    """Set the global random states captured by ``capture_rng_state``: all of them, or none on error."""
    _refuse(rng_state_problems(state), f"{source}: the random states cannot be restored; none was")
    random.setstate(_python_state(state["python"]))
    np.random.set_state(_numpy_state(state["numpy"]))
    torch.set_rng_state(state["torch_cpu"])
    if state["torch_cuda"]:
        torch.cuda.set_rng_state_all(state["torch_cuda"])
    if state["torch_mps"] is not None:
        torch.mps.set_rng_state(state["torch_mps"])


# --------------------------------------------------------------------------- training checkpoints
def checkpoint_name(sequence: int, step: int) -> str:
    """``ckpt-000007-step-00000042.pt``: the 7th save in its folder, taken after step 42."""
    return f"ckpt-{sequence:06d}-step-{step:08d}.pt"


def checkpoint_step(path: str | Path) -> int:
    """The step a checkpoint was taken after, from its name."""
    match = CHECKPOINT_PATTERN.match(Path(path).name)
    if match is None:
        raise CheckpointError(f"{path}: not a checkpoint name (expected ckpt-<sequence>-step-<step>.pt)")
    return int(match.group(2))


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Training checkpoint files in ``folder``, in the order they were saved (temporaries never match)."""
    folder = Path(folder)
    found = [(CHECKPOINT_PATTERN.match(path.name), path) for path in folder.iterdir()] if folder.is_dir() else []
    return [path for _, path in sorted((int(match.group(1)), path) for match, path in found if match and path.is_file())]


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The checkpoint saved last in ``folder`` (highest sequence, whatever its step), or None."""
    found = list_checkpoints(folder)
    return found[-1] if found else None


def save_training_checkpoint(folder: str | Path, trainer_state: Mapping[str, Any], *,
                             data_state: Mapping[str, Any] | None = None, model_config: Any = None,
                             keep_last: int = 3) -> Path:
    """Write ``trainer_state`` (``Trainer.state_dict()``), the RNG states and the data position; keep the newest ``keep_last``.

    Call it after an optimizer step, before the next batch is drawn. The name takes the next sequence
    past every name in ``folder`` that looks like a checkpoint. Nothing is written unless ``weights_only``
    can read it back; older checkpoints are deleted only once the new one is durable, never the new one.
    """
    folder = Path(folder)
    if type(keep_last) is not int or keep_last < 1:
        raise CheckpointError(f"{folder}: keep_last={keep_last!r}; must be an int >= 1, or the new checkpoint "
                              "would be deleted")
    step = trainer_state.get("step") if isinstance(trainer_state, Mapping) else None
    if type(step) is not int or step < 0:
        raise CheckpointError(f"{folder}: trainer_state['step'] is {step!r}; expected the trainer's "
                              "state_dict() with an int step")
    taken = [int(m.group(1)) for m in map(CHECKPOINT_PATTERN.match, (p.name for p in folder.glob("ckpt-*"))) if m]
    path = folder / checkpoint_name(max(taken, default=0) + 1, step)
    state = {"format": TRAINING_FORMAT, "format_version": TRAINING_FORMAT_VERSION, "trainer": dict(trainer_state),
             "rng": capture_rng_state(), "data": dict(data_state) if data_state is not None else None,
             "model_config": config_as_dict(model_config)}
    _refuse(plain_value_problems(state), f"{path}: not saved; torch.load(weights_only=True) could not read it back")
    _write_torch(path, state)
    stale = [old for old in list_checkpoints(folder)[:-keep_last] if old != path]
    stale += [left for left in folder.glob(".ckpt-*") if is_temporary(left) and left.is_file()]  # from a crashed save
    for old in stale:
        old.unlink(missing_ok=True)
    return path


def read_training_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a training checkpoint's dict (weights_only) and check its top-level structure."""
    path = Path(path)
    state = read_torch_file(path)
    if not isinstance(state, Mapping) or state.get("format") != TRAINING_FORMAT:
        found = "a weights file (a state_dict)" if isinstance(state, Mapping) else f"a {type(state).__name__}"
        raise CheckpointError(f"{path}: is {found}, not a training checkpoint (no format {TRAINING_FORMAT!r})")
    if state.get("format_version") != TRAINING_FORMAT_VERSION:
        raise CheckpointError(f"{path}: training checkpoint format version {state.get('format_version')!r}, "
                              f"this code reads version {TRAINING_FORMAT_VERSION}")
    missing = [key for key in CHECKPOINT_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"{path}: training checkpoint without {', '.join(repr(k) for k in missing)}")
    for key, allowed in (("trainer", Mapping), ("data", (Mapping, type(None))), ("model_config", (Mapping, type(None)))):
        if not isinstance(state[key], allowed):
            raise CheckpointError(f"{path}: {key!r} is a {type(state[key]).__name__}, expected a dict")
    return dict(state)


@dataclass
class Resumed:
    """What ``load_training_checkpoint`` restored that the caller itself must use."""

    path: Path
    step: int  # the number of optimizer steps already taken
    data_state: dict[str, Any] | None  # pass to the data stream's load_state_dict
    train_config_changes: list[str] = field(default_factory=list)  # the trainer applies the new config


def load_training_checkpoint(path: str | Path, trainer: Any, *, model_config: Any = None,
                             restore_rng: bool = True) -> Resumed:
    """Restore a run from ``path`` into ``trainer`` (and the global generators); return the step and data position.

    Everything is checked first, so on any error nothing has changed: the file, the model configuration
    (a different one is refused: the weights would not mean the same thing), every RNG state and the
    trainer's whole state (``trainer.state_dict_problems``). A changed training configuration (say a new
    learning rate) is applied by the trainer and listed in ``Resumed.train_config_changes``.
    """
    path = Path(path)
    state = read_training_checkpoint(path)
    problems = []
    if model_config is not None:
        problems += [f"model configuration: {line}" for line in
                     config_differences(state["model_config"], config_as_dict(model_config))]
    if restore_rng:
        problems += rng_state_problems(state["rng"])
    check = getattr(trainer, "state_dict_problems", None)
    if check is not None:
        problems += check(state["trainer"])
    _refuse(problems, f"{path}: cannot be restored; nothing was loaded")
    trainer.load_state_dict(state["trainer"])
    if restore_rng:
        restore_rng_state(state["rng"], path)
    current = getattr(trainer, "config", None)
    return Resumed(path=path, step=state["trainer"]["step"], data_state=state["data"],
                   train_config_changes=config_differences(state["trainer"].get("config"), config_as_dict(current))
                   if current is not None else [])


def load_weights_from_training_checkpoint(model: nn.Module, path: str | Path) -> nn.Module:
    """Load only the model weights from a training checkpoint (to evaluate or publish them)."""
    path = Path(path)
    weights = read_training_checkpoint(path)["trainer"].get("model")
    if not isinstance(weights, Mapping):
        raise CheckpointError(f"{path}: 'trainer' holds no 'model' state_dict")
    check_state_dict(model, weights, path)
    unwrap_model(model).load_state_dict(weights, strict=True)
    return model
