"""Exact resume: weights and the training state, saved atomically, parsed whole.

- **Weights** (``save_weights`` / ``load_weights``): a ``torch.save`` of
  the model's ``state_dict``. To publish weights, ``torchbook.weights``
  writes safetensors.
- **Training checkpoints** (``save_training_checkpoint`` /
  ``load_training_checkpoint``): the trainer's ``state_dict()`` (model,
  optimizer, scheduler, scaler, step, skipped steps, history, losses not
  yet logged, config), every rank's random generators (Python, NumPy,
  torch's CPU generator and the training accelerator's, captured by
  ``torchbook.rng_state``), the data position and the model config.

**What a load refuses, and what it trusts.** A load reads the whole file
into one typed value (``TrainingCheckpoint``; the trainer parses its own
part) and applies it only when every part fits, so it cannot stop
half-way. Before anything changes it refuses, with a ``CheckpointError``
naming the file:

- a file of another kind (the format tag and version): its dict would be
  misread;
- a truncated or bit-rotted file (the zip's end record, every member's CRC
  unless ``verify=False`` or ``mmap=True``): ``torch.load`` reads damaged
  bytes silently;
- a pickle that would run code (``weights_only=True``): unpickling can
  call any function the file names;
- another architecture (each key, shape and dtype): ``load_state_dict``
  copies every tensor that fits before it raises;
- another optimizer layout or a malformed optimizer state (groups,
  parameters, ``amsgrad``, each parameter's tensors and their shapes):
  torch loads it, and the next step fails;
- a missing or mistyped field (step, history, data position, configs),
  loss scaling switched on or off, or random states that do not restore
  here (each tried on a private generator; a generator of another device;
  another number of ranks).

It does not re-check the values inside a file this code wrote whose CRCs
hold (a learning rate, the numbers in a moment): a file valid in format
but crafted in content is out of scope, and files from strangers are
weights, in safetensors. Every file goes through
``torchbook.files.atomic_write`` (a crash leaves the previous file
whole), and is kept only if ``weights_only`` reads it back. The module
builds on ``torchbook.state_dicts`` (unwrapping, the key/shape/dtype
check, ``CheckpointError``) and ``torchbook.rng_state``.

**Rotation keeps the newest written.** A checkpoint's name carries a save
sequence beside its step (``ckpt-000007-step-00000042.pt``); "latest" and
"keep the last N" follow the sequence, never the step or the file's time,
so a run restarted from an older step keeps its new checkpoint. One
process writes to a folder at a time.

**What else exact resume depends on.** A deterministic run (the same
operations in the same order: ``torch.use_deterministic_algorithms(True)``,
a fixed number of CPU threads, the same device and versions). A
``DataLoader`` without a ``generator`` of its own draws a base seed from
the *global* torch generator every time it is iterated, even without
shuffling or workers: iterate it after ``restore_rng_state`` (or give it
its own ``generator``), and restore its position from the data state, as
``examples/resume_demo.py`` does with its ``TokenStream``.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.serialization import get_unsafe_globals_in_checkpoint

from torchbook.files import atomic_write, is_temporary
from torchbook.rng_state import (
    capture_rng_state,
    restore_rng_state,
    rng_device_problems,
    rng_state_problems,
)
from torchbook.state_dicts import (
    CheckpointError,
    check_state_dict,
    unwrap_model,
    unwrap_state_dict,
)

# Written into every training checkpoint so a file of another kind is recognised.
TRAINING_FORMAT = "torchbook.training_checkpoint"
# 5: the random states of every rank, a list by rank; the trainer's fp16 skips in a row
TRAINING_FORMAT_VERSION = 5
CHECKPOINT_PATTERN = re.compile(r"^ckpt-(\d{6,})-step-(\d{8,})\.pt$")


# ------------------------------------------------------------ reading torch files
def read_torch_file(
    path: str | Path, *, mmap: bool = False, verify: bool = True
) -> Any:
    """``torch.load`` to the CPU with ``weights_only=True``; errors name the file.

    The bytes are judged first: ``torch.save`` writes a zip archive
    (``PK``), safetensors an 8-byte length then ``{``, so a file of the
    other kind, an empty file or a truncated one gets an error that says
    so. ``verify`` checks the zip's CRCs, which ``torch.load`` does not:
    one extra read of the file, worth skipping only for a huge file you
    trust. ``mmap=True`` maps the tensors' bytes: pages are read on use.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    with open(path, "rb") as handle:
        head = handle.read(16)
    if not head.startswith(b"PK\x03\x04"):
        found = (
            "is empty (0 bytes); was the save interrupted?"
            if not head
            else "is a safetensors file; read it "
            "with torchbook.weights.read_safetensors()"
            if head[8:9] == b"{"
            else f"starts with {head!r}"
        )
        raise CheckpointError(
            f"{path}: not a file written by torch.save (a zip archive): it {found}"
        )
    if not zipfile.is_zipfile(path):  # the archive's end record is missing
        raise CheckpointError(
            f"{path}: truncated torch.save archive ({path.stat().st_size:,} bytes, no "
            "zip end record); was the write interrupted?"
        )
    if verify and (damage := _damaged_member(path)):
        raise CheckpointError(
            f"{path}: corrupt torch.save file{damage}; its bytes changed since written"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    # weights_only met something other than tensors and plain values
    except pickle.UnpicklingError as error:
        named = [x.strip() for x in str(error).splitlines() if "global" in x.lower()]
        detail = named[0] if named else _first_line(error)
        raise CheckpointError(
            f"{path}: refused by torch.load(weights_only=True): the file holds objects "
            "other than tensors and plain values, and rebuilding them could run code; "
            "load it with weights_only=False only if you made the file yourself. "
            f"(torch: {detail})"
        ) from error
    # RuntimeError, KeyError, ... for damage; OSError or MemoryError for the machine
    except Exception as error:
        raise CheckpointError(
            f"{path}: could not be read{_damaged_member(path)}: "
            f"{type(error).__name__}: {_first_line(error)}"
        ) from error


def _damaged_member(path: Path) -> str:
    """`` (member X fails its CRC)`` if the zip says a member changed, else ``""``."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        return f" (unreadable zip archive: {error})"
    return f" (member {bad} fails its CRC check)" if bad else ""


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


# ------------------------------------------------------------ weights
def _refuse(problems: list[str], message: str) -> None:
    """Raise CheckpointError if there are problems: ``message``, a line for each."""
    if problems:
        raise CheckpointError(f"{message}:\n  " + "\n  ".join(problems))


def _write_torch(path: Path, value: Any) -> Path:
    """``torch.save`` via ``atomic_write``; kept only if ``weights_only`` reads it."""

    def write(temporary: Path) -> None:
        torch.save(value, temporary)
        # torch's own weights_only allowlist
        if unreadable := get_unsafe_globals_in_checkpoint(temporary):
            raise CheckpointError(
                f"{path}: not saved; torch.load(weights_only=True) could not read it "
                f"back, as it holds {', '.join(unreadable)} (store tensors and plain "
                "values)"
            )

    try:
        return atomic_write(path, write)
    # torch.save reports a full disk as a RuntimeError
    except (OSError, RuntimeError) as error:
        raise CheckpointError(
            f"{path}: could not be written ({type(error).__name__}: "
            f"{_first_line(error)}); is the disk full? The previous file, if any, is "
            "unchanged"
        ) from error


def save_weights(model: nn.Module, path: str | Path) -> Path:
    """Atomically ``torch.save`` the ``state_dict``, wrapper prefixes removed."""
    return _write_torch(Path(path), unwrap_state_dict(model.state_dict()))


def load_weights(
    model: nn.Module,
    path: str | Path,
    *,
    mmap: bool = False,
    verify: bool | None = None,
) -> nn.Module:
    """Load weights from ``save_weights`` or a training checkpoint, checked first.

    Any ``torch.save(state_dict)`` file loads too, wrapper prefixes
    (``_orig_mod.``, ``module.``) removed. Keys, shapes and dtypes are
    checked before anything is copied, so a refused file leaves the model as
    it was. ``verify`` (default: ``not mmap``) checks every CRC, which reads
    the whole file: under ``mmap=True`` that would read every page the
    mapping was meant to spare, so it is off unless asked for.
    """
    path = Path(path)
    verify = not mmap if verify is None else verify
    state_dict = read_torch_file(path, mmap=mmap, verify=verify)
    if isinstance(state_dict, Mapping) and state_dict.get("format") == TRAINING_FORMAT:
        # to evaluate or publish a run's weights
        state_dict = state_dict["trainer"]["model"]
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(
            f"{path}: holds a {type(state_dict).__name__}, expected a state_dict (a "
            "dict of tensors)"
        )
    state_dict = unwrap_state_dict(state_dict)
    check_state_dict(model, state_dict, path)
    unwrap_model(model).load_state_dict(state_dict, strict=True)
    return model


# ------------------------------------------------------------ configurations
def config_as_dict(config: Any) -> dict[str, Any] | None:
    """A dataclass as a dict of its fields, as ``weights_only`` needs; others as is."""
    return (
        dataclasses.asdict(config)
        if dataclasses.is_dataclass(config) and not isinstance(config, type)
        else config
    )


def config_differences(
    saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None
) -> list[str]:
    """Fields whose values differ between two configuration dicts, as readable lines."""
    saved, current, absent = saved or {}, current or {}, "<absent>"
    return [
        f"{key}: {saved.get(key, absent)!r} in the checkpoint, "
        f"{current.get(key, absent)!r} now"
        for key in sorted(set(saved) | set(current), key=str)
        if saved.get(key, absent) != current.get(key, absent)
    ]


# ------------------------------------------------------------ every rank's generators
def _rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the number of ranks; (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_rng_states(device: torch.device | str) -> list[dict[str, Any]]:
    """Every rank's ``capture_rng_state``, by rank: a collective with several ranks.

    Each rank draws its own dropout masks (seeded by its rank), so a
    resumed rank needs its own generators back, not rank 0's; rank 0 writes
    them all into the one file.
    """
    mine, (_, world_size) = capture_rng_state(device), _rank_and_world_size()
    if world_size == 1:
        return [mine]
    states: list[Any] = [None] * world_size
    dist.all_gather_object(states, mine)  # the list is filled in place
    return states


# ------------------------------------------------------------ training checkpoints
def checkpoint_name(sequence: int, step: int) -> str:
    """``ckpt-000007-step-00000042.pt``: the 7th save in its folder, after step 42."""
    return f"ckpt-{sequence:06d}-step-{step:08d}.pt"


def list_checkpoints(folder: str | Path) -> list[Path]:
    """The checkpoints in ``folder``, in the order saved (temporaries never match)."""
    folder = Path(folder)
    found = [
        (int(match.group(1)), path)
        for path in (folder.iterdir() if folder.is_dir() else [])
        if (match := CHECKPOINT_PATTERN.match(path.name)) and path.is_file()
    ]
    return [path for _, path in sorted(found)]


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The checkpoint saved last in ``folder`` (highest sequence, any step), or None."""
    found = list_checkpoints(folder)
    return found[-1] if found else None


def save_training_checkpoint(
    folder: str | Path,
    trainer_state: Mapping[str, Any],
    *,
    device: torch.device | str,
    data_state: Mapping[str, Any] | None = None,
    model_config: Any = None,
    keep_last: int = 3,
) -> Path | None:
    """Save the trainer's state, RNG states and data position; keep ``keep_last``.

    ``trainer_state`` is ``Trainer.state_dict()``; ``device`` is the
    training device, whose generator is saved beside the CPU's. Call it
    after an optimizer step, before the next batch is drawn, so that the
    data position and the random states describe the same moment. With
    several ranks, call it on every rank: each sends its random states,
    rank 0 alone writes, and the others return None.

    The name takes the next sequence past every checkpoint name in
    ``folder``. Nothing is written unless ``weights_only`` can read it back;
    older checkpoints (and temporaries a crashed save left) are deleted only
    once the new one is durable, and the new one never.
    """
    folder = Path(folder)
    if type(keep_last) is not int or keep_last < 1:
        raise CheckpointError(
            f"{folder}: keep_last={keep_last!r}; must be an int >= 1, or the new "
            "checkpoint would be deleted"
        )
    rng = gather_rng_states(device)  # on every rank
    if _rank_and_world_size()[0] != 0:
        return None
    taken = [
        int(m.group(1))
        for m in map(CHECKPOINT_PATTERN.match, (p.name for p in folder.glob("ckpt-*")))
        if m
    ]
    path = folder / checkpoint_name(max(taken, default=0) + 1, trainer_state["step"])
    _write_torch(
        path,
        {
            "format": TRAINING_FORMAT,
            "format_version": TRAINING_FORMAT_VERSION,
            "trainer": dict(trainer_state),
            "rng": rng,
            "data": dict(data_state) if data_state is not None else None,
            "model_config": config_as_dict(model_config),
        },
    )
    stale = [old for old in list_checkpoints(folder)[:-keep_last] if old != path]
    stale += [  # temporaries of a crashed save
        left for left in folder.glob(".ckpt-*") if is_temporary(left) and left.is_file()
    ]
    for old in stale:
        old.unlink(missing_ok=True)
    return path


@dataclass(frozen=True)
class TrainingCheckpoint:
    """A training checkpoint read whole, its envelope checked: what a load applies."""

    path: Path
    trainer: dict[str, Any]  # Trainer.state_dict(), parsed by the trainer itself
    rng: list[dict[str, Any]]  # capture_rng_state()'s dict of each rank, by rank
    data: dict[str, Any] | None  # the stream's state_dict, for its load_state_dict
    model_config: dict[str, Any] | None

    def config_changes(self, train_config: Any) -> list[str]:
        """What a resumed run with ``train_config`` (a ``TrainConfig``) changes."""
        return config_differences(
            self.trainer.get("config"), config_as_dict(train_config)
        )


def read_training_checkpoint(path: str | Path) -> TrainingCheckpoint:
    """Read a checkpoint (``weights_only``, CRCs checked), parse it; apply nothing."""
    path = Path(path)
    state = read_torch_file(path)
    known = isinstance(state, Mapping)
    tag = (state.get("format"), state.get("format_version")) if known else (None, None)
    if tag != (TRAINING_FORMAT, TRAINING_FORMAT_VERSION):
        raise CheckpointError(
            f"{path}: not a training checkpoint this code reads: format {tag[0]!r} "
            f"version {tag[1]!r}, expected {TRAINING_FORMAT!r} version "
            f"{TRAINING_FORMAT_VERSION}"
        )
    problems = [
        f"{key!r}: {type(state.get(key)).__name__}, expected a dict"
        for key, kinds in (
            ("trainer", dict),
            ("data", (dict, type(None))),
            ("model_config", (dict, type(None))),
        )
        if not isinstance(state.get(key), kinds)
    ]
    rng = state.get("rng")
    if isinstance(rng, list) and rng:
        problems += [line for saved in rng for line in rng_state_problems(saved)]
    else:
        problems.append(f"rng: {rng!r:.40}, expected a list of each rank's states")
    _refuse(problems, f"{path}: not a usable training checkpoint; nothing was loaded")
    return TrainingCheckpoint(
        path, state["trainer"], state["rng"], state["data"], state["model_config"]
    )


def load_training_checkpoint(
    path: str | Path,
    trainer: Any,
    *,
    model_config: Any = None,
    restore_rng: bool = True,
) -> TrainingCheckpoint:
    """Restore ``trainer`` and global generators from ``path``; return what was read.

    Parse, then apply. First the file, the model configuration (a
    different one is refused: the weights would not mean the same thing)
    and the random states are checked; then ``trainer.load_state_dict``
    parses its own state before it changes anything; each rank's own
    generators (saved by as many ranks) are set last, which cannot fail.

    The caller restores its data position from the returned ``data``. A
    changed training configuration (a new learning rate) is not an error:
    continuing with new settings is legitimate, though no longer exact. It
    is applied, and ``config_changes(trainer.config)`` lists it.
    """
    checkpoint = read_training_checkpoint(path)
    rank, world_size = _rank_and_world_size()
    problems = []
    if restore_rng and len(checkpoint.rng) != world_size:
        problems.append(
            f"rng: the random states of {len(checkpoint.rng)} ranks in the file, "
            f"{world_size} here; pass restore_rng=False to resume without them"
        )
    elif restore_rng:
        problems += rng_device_problems(checkpoint.rng[rank], trainer.device)
    if model_config is not None:
        ours = config_as_dict(model_config)
        changed = config_differences(checkpoint.model_config, ours)
        problems += [f"model configuration: {line}" for line in changed]
    _refuse(problems, f"{checkpoint.path}: cannot be restored; nothing was loaded")
    try:
        trainer.load_state_dict(checkpoint.trainer)
    except ValueError as error:  # the trainer refused before changing anything
        raise CheckpointError(
            f"{checkpoint.path}: cannot be restored; nothing was loaded:\n  {error}"
        ) from error
    if restore_rng:
        restore_rng_state(checkpoint.rng[rank], trainer.device)
    return checkpoint
