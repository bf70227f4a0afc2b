"""Publishing weights: safetensors, tied weights, a sharded index, the meta device.

A safetensors file is an 8-byte header length, a JSON header (each tensor's
dtype, shape and byte range) and the raw bytes: loading it runs no code, and
``safe_open`` reads single tensors without reading the rest.

- **Tied weights** follow ``safetensors.torch.save_model`` / ``load_model``:
  names that share one tensor are stored once, under the first name in sorted
  order, and each dropped name is recorded in the file's metadata as
  ``{dropped: kept}``. Reading restores the dropped names from that metadata;
  loading into a model also re-ties from the model's own structure, so files
  written by ``save_model`` load here and files written here load with
  ``load_model``.
- **Sharded**: the Hugging Face hub layout, ``model-0000i-of-0000n.safetensors``
  plus ``model.safetensors.index.json`` whose ``weight_map`` names the file of
  each tensor, so a reader opens only the shards it needs.
- **Meta device**: ``load_on_meta`` builds the model under
  ``torch.device("meta")`` (shapes, no memory, no random initialisation),
  adopts the checkpoint's tensors with ``load_state_dict(assign=True)``, and
  initialises the non-persistent buffers (masks, RoPE tables) explicitly, as
  torchtitan does. Nothing process-wide is patched.

Every write goes through ``torchbook.files.atomic_write``; every error is a
``CheckpointError`` naming the file (and the field), the same class as
``torchbook.checkpoint``'s, raised before the model changes. The module
builds on ``torchbook.state_dicts``: the unwrap of torch.compile and DDP
wrappers, the key/shape/dtype check before loading, and that error class.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import nn

from torchbook.files import atomic_write, atomic_write_text
from torchbook.state_dicts import (
    LISTED_KEYS,
    CheckpointError,
    check_state_dict,
    unwrap_model,
    unwrap_state_dict,
)

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Key of aliases (as JSON) in files from this module's earlier versions; still read.
LEGACY_ALIASES_KEY = "torchbook.aliases"

# ------------------------------------------------------------ state dicts


def _share_tied(state_dict: dict[str, torch.Tensor], ties: Iterable[list[str]]) -> None:
    """Give each tied name missing from ``state_dict`` the tensor of one it holds.

    A tied tensor is stored once, as safetensors does.
    """
    for names in ties:
        present = [name for name in names if name in state_dict]
        for name in names:
            if present and name not in state_dict:
                state_dict[name] = state_dict[present[0]]


def drop_shared(
    state_dict: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep one name per shared tensor; return the tensors and ``{dropped: kept}``.

    The name kept is the first in sorted order, as in ``save_model``. A tied embedding
    and output head appear in ``state_dict`` under two names for one tensor.
    ``torch.save`` keeps the sharing; safetensors stores each name's bytes separately
    and refuses shared memory. Tensors that share memory but are different views of it
    cannot be stored once: refused.
    """
    by_storage: dict[int, list[str]] = {}
    for name, tensor in state_dict.items():
        if tensor.numel():
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(name)
    aliases: dict[str, str] = {}
    for names in by_storage.values():
        kept, *dropped = sorted(names)
        for name in dropped:
            a, b = state_dict[kept], state_dict[name]
            if (a.storage_offset(), a.shape, a.stride(), a.dtype) != (
                b.storage_offset(),
                b.shape,
                b.stride(),
                b.dtype,
            ):
                raise CheckpointError(
                    f"{name}: shares memory with {kept} but is a different view of "
                    "it; safetensors cannot store overlapping tensors (clone one of "
                    "them first)"
                )
            aliases[name] = kept
    tensors = {
        name: tensor.detach().contiguous()
        for name, tensor in state_dict.items()
        if name not in aliases
    }
    return tensors, aliases


def _to_publish(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor], target: Path
) -> tuple[dict, dict[str, str]]:
    state_dict = (
        unwrap_model(model_or_state_dict).state_dict()
        if isinstance(model_or_state_dict, nn.Module)
        else unwrap_state_dict(model_or_state_dict)
    )
    try:
        return drop_shared(state_dict)
    except CheckpointError as error:
        raise CheckpointError(f"{target}: not written; {error}") from error


def _write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> Path:
    try:
        return atomic_write(
            path,
            lambda temporary: safetensors.torch.save_file(
                dict(tensors), temporary, metadata=dict(metadata)
            ),
        )
    except OSError as error:
        raise CheckpointError(
            f"{path}: could not be written ({type(error).__name__}: {error}); "
            "is the disk full? The previous file, if any, is unchanged"
        ) from error


# ------------------------------------------------------------ one file


def save_safetensors(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    path: str | Path,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Export weights to one safetensors file, atomically, each tied tensor once."""
    tensors, aliases = _to_publish(model_or_state_dict, Path(path))
    header = {str(key): str(value) for key, value in (metadata or {}).items()}
    clash = sorted(set(header) & (set(tensors) | set(aliases)))
    if clash:
        raise CheckpointError(
            f"{path}: metadata keys {clash} are tensor names; they would be read "
            "as aliases"
        )
    header.update(aliases)
    return _write_safetensors(Path(path), tensors, header)


def _aliases(
    metadata: Mapping[str, str], stored: set[str], source: Path
) -> dict[str, str]:
    """``{dropped: kept}`` from ``save_model``'s metadata or the legacy key, checked."""
    aliases = {
        name: kept
        for name, kept in metadata.items()
        if kept in stored and name not in stored
    }
    if LEGACY_ALIASES_KEY in metadata:
        try:
            legacy = json.loads(metadata[LEGACY_ALIASES_KEY])
        except ValueError as error:
            raise CheckpointError(
                f"{source}: metadata field {LEGACY_ALIASES_KEY!r} is not JSON ({error})"
            ) from error
        if not isinstance(legacy, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in legacy.items()
        ):
            raise CheckpointError(
                f"{source}: metadata field {LEGACY_ALIASES_KEY!r} is not a JSON "
                "object of names"
            )
        missing = sorted(kept for kept in legacy.values() if kept not in stored)
        if missing:
            raise CheckpointError(
                f"{source}: metadata field {LEGACY_ALIASES_KEY!r} names tensors the "
                f"file does not hold: {missing}"
            )
        aliases.update(legacy)
    return aliases


def open_safetensors(path: Path, device: str = "cpu") -> safetensors.safe_open:
    """``safe_open`` on ``path`` (the header only), or a CheckpointError naming it.

    A missing, truncated or foreign file is refused with its path instead of
    safetensors' own message, which does not name the file.
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        return safetensors.safe_open(path, framework="pt", device=device)
    except (safetensors.SafetensorError, OSError) as error:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({error}); was the write "
            "interrupted?"
        ) from error


def read_safetensors(
    path: str | Path, *, names: Iterable[str] | None = None, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Read all tensors, or only ``names``, of a safetensors file with ``safe_open``.

    Tied names share one tensor again.
    """
    path = Path(path)
    with open_safetensors(path, device) as handle:
        stored = set(handle.keys())
        aliases = _aliases(handle.metadata() or {}, stored, path)
        wanted = sorted(stored | set(aliases)) if names is None else list(names)
        unknown = [
            name for name in wanted if name not in stored and name not in aliases
        ]
        if unknown:
            raise CheckpointError(f"{path}: no tensor named {unknown[:LISTED_KEYS]}")
        try:
            tensors = {
                name: handle.get_tensor(name)
                for name in {aliases.get(n, n) for n in wanted}
            }
        except safetensors.SafetensorError as error:
            raise CheckpointError(
                f"{path}: unreadable tensor data ({error}); was the write interrupted?"
            ) from error
    return {name: tensors[aliases.get(name, name)] for name in wanted}


def load_safetensors(model: nn.Module, path: str | Path) -> nn.Module:
    """Load safetensors weights into ``model``, checked first, ties kept.

    ``path`` is one file, a sharded folder or its index.
    """
    path = Path(path)
    sharded = path.is_dir() or path.suffix == ".json"
    state_dict = read_sharded_safetensors(path) if sharded else read_safetensors(path)
    inner = unwrap_model(model)
    # Like load_model: a name the model ties to a stored one needs no bytes of its own.
    groups: dict[int, list[str]] = {}
    for name, tensor in inner.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    _share_tied(state_dict, groups.values())
    check_state_dict(inner, state_dict, path)
    inner.load_state_dict(state_dict, strict=True)
    return model


# ------------------------------------------------------------ sharded


def save_sharded_safetensors(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    folder: str | Path,
    max_shard_bytes: int,
) -> Path:
    """Save weights as ``model-0000i-of-0000n.safetensors`` shards and their index.

    Each shard holds whole tensors, so one larger than ``max_shard_bytes`` gets a shard
    of its own; a tied name is recorded in the metadata of the shard that holds its
    tensor. The index, ``model.safetensors.index.json``, is written last: until it
    exists, no shard set is complete. A previous save in ``folder`` loses its index
    first, so that it never names half-overwritten shards, and its leftover shards
    last.
    """
    tensors, aliases = _to_publish(model_or_state_dict, Path(folder))
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
    (folder / SAFETENSORS_INDEX).unlink(missing_ok=True)
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(
            folder / filename,
            shard,
            {name: kept for name, kept in aliases.items() if kept in shard},
        )
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    index_path = atomic_write_text(
        folder / SAFETENSORS_INDEX, json.dumps(index, indent=2) + "\n"
    )
    for shard_path in folder.glob("model-*-of-*.safetensors"):
        if shard_path.name not in weight_map.values():  # a previous save's
            shard_path.unlink()
    return index_path


def read_index(folder_or_index: str | Path) -> tuple[Path, dict[str, str]]:
    """The index file and its ``weight_map``, every field checked.

    A CheckpointError names the file and the field.
    """
    index_path = Path(folder_or_index)
    if index_path.is_dir():
        index_path = index_path / SAFETENSORS_INDEX
    if not index_path.is_file():
        raise CheckpointError(f"{index_path}: no such file")
    try:
        index = json.loads(index_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(
            f"{index_path}: not a JSON index ({type(error).__name__}: {error})"
        ) from error
    if not isinstance(index, dict):
        raise CheckpointError(
            f"{index_path}: the index is a JSON {type(index).__name__}, expected an "
            "object"
        )
    if not isinstance(index.get("metadata", {}), dict):
        raise CheckpointError(
            f"{index_path}: field 'metadata' is a "
            f"{type(index['metadata']).__name__}, expected an object"
        )
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{index_path}: field 'weight_map' is a {type(weight_map).__name__}, "
            "expected an object {tensor name: shard file}"
        )
    for name, filename in weight_map.items():
        if (
            not isinstance(filename, str)
            or Path(filename).name != filename
            or not filename.endswith(".safetensors")
        ):
            raise CheckpointError(
                f"{index_path}: field 'weight_map'[{name!r}] is {filename!r}, "
                "expected the name of a .safetensors file in the same folder"
            )
    return index_path, weight_map


def read_sharded_safetensors(
    folder_or_index: str | Path, names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Read a sharded checkpoint's tensors (all or ``names``) from only their shards."""
    index_path, weight_map = read_index(folder_or_index)
    files = list(dict.fromkeys(weight_map.values()))
    if names is None:
        found: dict[str, torch.Tensor] = {}
        for filename in files:
            found.update(read_safetensors(index_path.parent / filename))
        return found
    wanted = list(names)
    where = dict(weight_map)
    if any(name not in where for name in wanted):
        # A tied name has no bytes of its own: it is in the metadata of the shard
        # holding its tensor.
        for filename in files:
            shard = index_path.parent / filename
            with open_safetensors(shard) as handle:  # reads the header only
                links = _aliases(handle.metadata() or {}, set(handle.keys()), shard)
            where.update(
                {
                    name: filename
                    for name in wanted
                    if name in links and name not in where
                }
            )
    unknown = [name for name in wanted if name not in where]
    if unknown:
        raise CheckpointError(
            f"{index_path}: no tensor named {unknown[:LISTED_KEYS]} in field "
            "'weight_map'"
        )
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(where[name], []).append(name)
    found = {}
    for filename, shard_names in by_file.items():
        found.update(read_safetensors(index_path.parent / filename, names=shard_names))
    return {name: found[name] for name in wanted}


# ------------------------------------------------------------ big models, meta device


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters and buffers on the meta device (no values)."""
    return [
        name
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if tensor.is_meta
    ]


def load_on_meta(
    build: Callable[[], nn.Module],
    state_dict: Mapping[str, torch.Tensor],
    source: str | Path,
    init_buffers: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Build a model on meta, adopt the checkpoint's tensors, fill the buffers it lacks.

    Under ``torch.device("meta")`` parameters and buffers have shapes but no
    memory, so no random initialisation is computed and thrown away and memory
    holds one copy of the weights. ``load_state_dict(assign=True)`` makes the
    loaded tensors the parameters (loaded with ``mmap=True`` they stay in the
    file's pages until used); tied weights are tied again afterwards.
    Non-persistent buffers (``persistent=False``: causal masks, RoPE tables)
    are in no checkpoint: ``init_buffers(model)`` must set them, as torchtitan's
    models do in their ``init_weights``. Until then they are meta, and an error
    lists them.
    """
    with torch.device("meta"):
        model = build()
    ties: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(parameter), []).append(name)
    state_dict = dict(state_dict)
    _share_tied(state_dict, ties.values())
    check_state_dict(model, state_dict, source)
    model.load_state_dict(state_dict, assign=True, strict=True)
    for names in ties.values():
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attribute, shared)
    if init_buffers is not None:
        init_buffers(model)
    still_meta = meta_tensors(model)
    if still_meta:
        raise CheckpointError(
            f"{source}: after loading, {still_meta} are still on the meta device, "
            "with no values (buffers that state_dict does not save); pass "
            "init_buffers= to compute them"
        )
    return model
