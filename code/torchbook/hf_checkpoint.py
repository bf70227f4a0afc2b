"""Hugging Face model folders into the book's Llama, and back.

A checkpoint on the Hugging Face hub is a folder: ``config.json`` (the
architecture and its sizes) and the weights, either ``model.safetensors`` or
shards named by ``model.safetensors.index.json``. Loading it is parse, then
apply, as in chapter 5:

1. ``read_llama_config`` (``torchbook.hf_llama_config``): config.json into a
   ``LlamaConfig``, each field read, refused by name where the module would
   compute something else, or ignored by name where it changes nothing.
2. ``read_checkpoint``: every shard's header, read with ``safe_open`` (no
   tensor data yet). Each key is renamed with ``KEY_MAP``; the keys
   transformers ignores on load (``IGNORED_KEYS``: Llama 2's stored RoPE
   tables) are ignored by name; a missing shard, a key the table does not
   know, or a key the index places in another file is refused with the file
   and the key named.
3. ``load_weights``: every name and shape compared with the model on meta
   tensors, which have no data (``torchbook.state_dicts``' one check), and a
   tied head stored anyway compared with the embedding; only then is each
   tensor read from its shard, converted to its target's dtype and copied, so
   a refused folder leaves the model as it was, and a bf16 model loaded from
   float32 files never holds a float32 copy.

``save_hf_folder`` writes what ``save_pretrained`` writes: config.json (in the
keys both transformers 4 and 5 read, special tokens included),
generation_config.json, and the weights through huggingface_hub's
``save_torch_state_dict``, which shards them as the hub does and removes an
earlier save's weight files.

What is trusted: safetensors headers and tensors (no code runs on load). A
``pytorch_model.bin`` is a pickle and is not read.

It builds on ``torchbook.llama`` (the model), ``torchbook.hf_llama_config``
(config.json both ways), ``torchbook.weights`` (the index, opening a
safetensors file) and ``torchbook.state_dicts``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import torch
from torch import nn

from torchbook.files import atomic_write_text
from torchbook.hf_llama_config import (
    config_dtype,
    config_json,
    generation_config_json,
    read_llama_config,
)
from torchbook.llama import Llama, LlamaConfig
from torchbook.state_dicts import CheckpointError, check_state_dict
from torchbook.weights import SAFETENSORS_INDEX, open_safetensors, read_index

SINGLE_FILE = "model.safetensors"

# Hugging Face's tensor name -> the book's; {layer} stands for the block's number.
KEY_MAP = {
    "model.embed_tokens.weight": "token_embedding.weight",
    "model.layers.{layer}.input_layernorm.weight": "blocks.{layer}.norm_attn.weight",
    "model.layers.{layer}.self_attn.q_proj.weight": "blocks.{layer}.attn.query.weight",
    "model.layers.{layer}.self_attn.k_proj.weight": "blocks.{layer}.attn.key.weight",
    "model.layers.{layer}.self_attn.v_proj.weight": "blocks.{layer}.attn.value.weight",
    "model.layers.{layer}.self_attn.o_proj.weight": "blocks.{layer}.attn.proj.weight",
    "model.layers.{layer}.post_attention_layernorm.weight": (
        "blocks.{layer}.norm_mlp.weight"
    ),
    "model.layers.{layer}.mlp.gate_proj.weight": "blocks.{layer}.mlp.gate.weight",
    "model.layers.{layer}.mlp.up_proj.weight": "blocks.{layer}.mlp.up.weight",
    "model.layers.{layer}.mlp.down_proj.weight": "blocks.{layer}.mlp.down.weight",
    "model.norm.weight": "norm_final.weight",
    "lm_head.weight": "lm_head.weight",
}

# Keys transformers ignores by name on load (modeling_utils: old checkpoints, Llama
# 2's among them, stored each layer's RoPE frequencies, now computed from config).
IGNORED_KEYS = ("model.layers.{layer}.self_attn.rotary_emb.inv_freq",)

# safetensors' dtype names for the floating-point dtypes a Llama's weights come in.
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _match(pattern: str, key: str) -> re.Match | None:
    """``key`` matched against a ``KEY_MAP`` pattern, ``{layer}`` any number."""
    regex = r"(\d+)".join(re.escape(part) for part in pattern.split("{layer}"))
    return re.fullmatch(regex, key)


def _rename(key: str, table: dict[str, str]) -> str | None:
    """``key`` renamed by the first pattern of ``table`` it matches, else None."""
    for pattern, target in table.items():
        match = _match(pattern, key)
        if match:
            return target.format(layer=match.group(1)) if match.groups() else target
    return None


def book_key(hf_key: str) -> str | None:
    """The book's name for a Hugging Face tensor name, or None if it has none."""
    return _rename(hf_key, KEY_MAP)


def hf_key(key: str) -> str | None:
    """The Hugging Face name for one of the book's tensor names, or None."""
    return _rename(key, {book: hf for hf, book in KEY_MAP.items()})


def hf_module(name: str) -> str:
    """The Hugging Face name of one of the book's layers (for PEFT's adapter keys)."""
    renamed = hf_key(f"{name}.weight")
    if renamed is None:
        raise KeyError(f"{name!r} is not a layer KEY_MAP names")
    return renamed.removesuffix(".weight")


# ------------------------------------------------------------ parse the weights


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies and what it is, read from its shard's header."""

    file: Path
    name: str  # its Hugging Face name, in that file
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class HFCheckpoint:
    """A parsed model folder: its config, and every tensor by the book's name.

    ``dtype`` is the one to build the model in by default: config.json's, as
    transformers 5's ``dtype="auto"`` takes it, else the embedding's.
    ``tied_head`` is a head stored although config.json ties it to the
    embedding; it loads only if it equals the embedding.
    """

    folder: Path
    config: LlamaConfig
    tensors: dict[str, StoredTensor]
    dtype: torch.dtype
    tied_head: StoredTensor | None = None


def _weight_files(folder: Path) -> tuple[Path, dict[str, str] | None]:
    """The file that lists the weights, and the index's weight_map (None: one file)."""
    if (folder / SAFETENSORS_INDEX).is_file():
        return read_index(folder)
    if (folder / SINGLE_FILE).is_file():
        return folder / SINGLE_FILE, None
    raise CheckpointError(
        f"{folder}: neither {SINGLE_FILE} nor {SAFETENSORS_INDEX}; a "
        "pytorch_model.bin is a pickle, which this loader does not read"
    )


def read_checkpoint(folder: str | Path) -> HFCheckpoint:
    """Parse a model folder: config and every shard's header, each key mapped.

    Reads no tensor data. A ``CheckpointError`` names the file and the key.
    """
    folder = Path(folder)
    config = read_llama_config(folder / "config.json")
    listing, weight_map = _weight_files(folder)
    files = (
        [SINGLE_FILE]
        if weight_map is None
        else list(dict.fromkeys(weight_map.values()))
    )
    for filename in files:
        if not (folder / filename).is_file():
            raise CheckpointError(
                f"{listing}: names shard {filename}, which is missing"
            )
    tensors: dict[str, StoredTensor] = {}
    tied_head, found = None, set()
    for filename in files:
        with open_safetensors(folder / filename) as handle:  # the header only
            for name in handle.keys():
                where = folder / filename
                found.add(name)
                if weight_map is not None and weight_map.get(name) != filename:
                    raise CheckpointError(
                        f"{where}: holds {name!r}, which {listing.name} places in "
                        f"{weight_map.get(name)}"
                    )
                if any(_match(pattern, name) for pattern in IGNORED_KEYS):
                    continue  # as transformers does
                key, header = book_key(name), handle.get_slice(name)
                if key is None:
                    raise CheckpointError(
                        f"{where}: tensor {name!r} has no place in the book's Llama"
                    )
                if header.get_dtype() not in DTYPES:
                    raise CheckpointError(
                        f"{where}: tensor {name!r} is {header.get_dtype()}, expected "
                        f"one of {sorted(DTYPES)}"
                    )
                stored = StoredTensor(
                    where, name, tuple(header.get_shape()), DTYPES[header.get_dtype()]
                )
                if key == "lm_head.weight" and config.tie_embeddings:
                    tied_head = stored  # compared with the embedding before loading
                else:
                    tensors[key] = stored
    unlisted = sorted(set(weight_map or {}) - found)
    if unlisted:
        raise CheckpointError(
            f"{listing}: names {unlisted[0]!r} in {weight_map[unlisted[0]]}, "
            "which does not hold it"
        )
    dtype = config_dtype(folder / "config.json")
    if dtype is None:  # the embedding's, as transformers' "auto" takes the weights'
        embedding = tensors.get("token_embedding.weight")
        dtype = embedding.dtype if embedding else torch.float32
    return HFCheckpoint(folder, config, tensors, dtype, tied_head)


# ------------------------------------------------------------ apply


def load_weights(model: Llama, checkpoint: HFCheckpoint | str | Path) -> Llama:
    """Copy a checkpoint's tensors into ``model``, after checking all of them.

    The config must be ``model``'s, and every name and shape must fit (compared
    on meta tensors, which have shapes and no data); then each shard is opened
    once and its tensors copied, each converted to the dtype of the tensor it
    fills. Nothing changes before the checks pass.
    """
    if not isinstance(checkpoint, HFCheckpoint):
        checkpoint = read_checkpoint(checkpoint)
    if checkpoint.config != model.config:
        differ = [
            f"{name}: {value!r} in config.json, "
            f"{getattr(model.config, name)!r} in the model"
            for name, value in vars(checkpoint.config).items()
            if getattr(model.config, name) != value
        ]
        raise CheckpointError(
            f"{checkpoint.folder / 'config.json'}: another model; " + "; ".join(differ)
        )
    targets = model.state_dict(keep_vars=True)
    shapes = {}
    for key, stored in checkpoint.tensors.items():
        # copy_ converts each tensor to its target's dtype: names and shapes count
        dtype = targets[key].dtype if key in targets else stored.dtype
        shapes[key] = torch.empty(stored.shape, dtype=dtype, device="meta")
    if model.config.tie_embeddings and "token_embedding.weight" in shapes:
        shapes["lm_head.weight"] = shapes["token_embedding.weight"]  # one tensor
    check_state_dict(model, shapes, checkpoint.folder)
    if checkpoint.tied_head is not None:
        _check_tied_head(checkpoint)
    by_file: dict[Path, list[str]] = {}
    for key, stored in checkpoint.tensors.items():
        by_file.setdefault(stored.file, []).append(key)
    with torch.no_grad():
        for path, keys in by_file.items():
            with open_safetensors(path) as handle:
                for key in keys:
                    targets[key].copy_(handle.get_tensor(checkpoint.tensors[key].name))
    return model


def _check_tied_head(checkpoint: HFCheckpoint) -> None:
    """Refuse a stored head that differs from the embedding config.json ties it to.

    transformers 5 would compute with such a head as stored, untied; the book's
    module ties it, so only a copy of the embedding is accepted (and ignored).
    """
    head, embedding = checkpoint.tied_head, checkpoint.tensors["token_embedding.weight"]
    with open_safetensors(head.file) as handle:
        stored_head = handle.get_tensor(head.name)
    with open_safetensors(embedding.file) as handle:
        stored_embedding = handle.get_tensor(embedding.name)
    if not torch.equal(stored_head.to(stored_embedding.dtype), stored_embedding):
        raise CheckpointError(
            f"{head.file}: holds {head.name!r}, which differs from "
            f"{embedding.name!r}, while config.json ties them "
            "(tie_word_embeddings: true)"
        )


def load_pretrained(
    folder: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> Llama:
    """Build the book's Llama from a model folder, in ``dtype`` or the folder's.

    The model is built on the meta device and given uninitialised memory in its
    final dtype (``to_empty``), so no random initialisation is computed and
    then overwritten, and each tensor is converted as it is copied in.
    """
    checkpoint = read_checkpoint(folder)
    with torch.device("meta"):
        model = Llama(checkpoint.config)
    model = model.to(dtype or checkpoint.dtype).to_empty(device=device)
    if model.config.tie_embeddings:  # to_empty gives each name its own new tensor
        model.lm_head.weight = model.token_embedding.weight
    return load_weights(model, checkpoint)


# ------------------------------------------------------------ save back


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s tensors under Hugging Face's names; a tied head is left out.

    transformers saves a tied head that way and ties it again on loading.
    """
    state_dict = model.state_dict()
    if getattr(model.config, "tie_embeddings", False):
        state_dict.pop("lm_head.weight")
    renamed = {key: hf_key(key) for key in state_dict}
    unnamed = [key for key, name in renamed.items() if name is None]
    if unnamed:
        raise CheckpointError(
            f"{unnamed[0]} has no Hugging Face name; merge LoRA adapters first "
            "(torchbook.lora.merge_lora)"
        )
    return {renamed[key]: tensor for key, tensor in state_dict.items()}


def save_hf_folder(model: Llama, folder: str | Path, max_shard_bytes: int) -> Path:
    """Save ``model`` as ``save_pretrained`` does, with shards of ``max_shard_bytes``.

    config.json, generation_config.json, and the weights written by
    huggingface_hub's ``save_torch_state_dict``: one model.safetensors, or
    shards and their index, named as the hub names them. It first removes the
    weight files of an earlier save in ``folder``: an old model.safetensors
    left beside new shards is the file transformers would load.
    """
    folder = Path(folder)
    try:
        tensors = hf_state_dict(model)
    except CheckpointError as error:
        raise CheckpointError(f"{folder}: not written; {error}") from error
    folder.mkdir(parents=True, exist_ok=True)
    huggingface_hub.save_torch_state_dict(
        tensors, folder, max_shard_size=max_shard_bytes
    )
    dtype = model.token_embedding.weight.dtype
    for name, content in (
        ("config.json", config_json(model.config, dtype)),
        ("generation_config.json", generation_config_json(model.config)),
    ):
        atomic_write_text(folder / name, json.dumps(content, indent=2) + "\n")
    return folder
