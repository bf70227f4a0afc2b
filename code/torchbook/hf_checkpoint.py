"""Hugging Face model folders into the book's Llama, and back.

A checkpoint on the Hugging Face hub is a folder: ``config.json`` (the
architecture and its sizes) and the weights, either ``model.safetensors`` or
shards named by ``model.safetensors.index.json``. Loading it is parse, then
apply, as in chapter 5:

1. ``read_config``: config.json into a ``LlamaConfig`` (``CONFIG_KEYS`` names
   each field), refusing by name what the module does not implement: another
   ``model_type``, another RoPE scaling than Llama 3's, biases in attention or
   MLP, a sliding window, another activation, quantized weights.
2. ``read_checkpoint``: every shard's header, read with ``safe_open`` (no
   tensor data yet). Each key is renamed with ``KEY_MAP``; a missing shard, a
   key the table does not know, or a key the index places in another file is
   refused with the file and the key named.
3. ``load_weights``: every name, shape and dtype compared with the model on
   meta tensors, which have no data (``torchbook.state_dicts``' one check); only
   then is each tensor read from its shard and copied, so a refused folder
   leaves the model as it was.

``save_hf_folder`` writes the same layout back (config.json in the keys both
transformers 4 and 5 read, shards and index through ``torchbook.weights``), and
``LlamaForCausalLM.from_pretrained`` loads it.

What is trusted: safetensors headers and tensors (no code runs on load). A
``pytorch_model.bin`` is a pickle and is not read.

It builds on ``torchbook.llama`` (the model), ``torchbook.weights`` (the index,
opening a safetensors file, sharded writing) and ``torchbook.state_dicts``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchbook.files import atomic_write_text
from torchbook.llama import Llama, Llama3RopeScaling, LlamaConfig
from torchbook.state_dicts import CheckpointError, check_state_dict
from torchbook.weights import (
    SAFETENSORS_INDEX,
    open_safetensors,
    read_index,
    save_sharded_safetensors,
)

SINGLE_FILE = "model.safetensors"

# config.json field -> LlamaConfig field.
CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "num_key_value_heads": "n_kv_head",
    "hidden_size": "d_model",
    "intermediate_size": "mlp_size",
    "head_dim": "head_size",
    "max_position_embeddings": "max_positions",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
}

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

# safetensors' dtype names for the floating-point dtypes a Llama's weights come in.
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _rename(key: str, table: dict[str, str]) -> str | None:
    """``key`` renamed by the first pattern of ``table`` it matches, else None."""
    for pattern, target in table.items():
        regex = r"(\d+)".join(re.escape(part) for part in pattern.split("{layer}"))
        match = re.fullmatch(regex, key)
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


# ------------------------------------------------------------ config.json


def _refusals(raw: dict[str, Any]) -> list[str]:
    """What ``raw`` asks for that the book's Llama does not compute, in words."""
    refused = []
    if raw.get("model_type") != "llama":
        refused.append(
            f"model_type {raw.get('model_type')!r} (only 'llama' is implemented)"
        )
    if raw.get("hidden_act", "silu") != "silu":
        refused.append(f"hidden_act {raw['hidden_act']!r} (SwiGLU uses 'silu')")
    for field in ("attention_bias", "mlp_bias"):
        if raw.get(field):
            refused.append(f"{field}: true (the module's linear layers have no bias)")
    if raw.get("sliding_window") is not None:
        refused.append(
            f"sliding_window {raw['sliding_window']} (attention here sees the "
            "whole past)"
        )
    if raw.get("quantization_config") is not None:
        refused.append(
            "quantization_config (quantized weights are not dequantized here)"
        )
    return refused


def _rope(raw: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None, str | None]:
    """RoPE's base and scaling from transformers 5's ``rope_parameters`` or 4's keys.

    The third value names a RoPE type that is refused (None when accepted).
    """
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None, None
    if kind != "llama3":
        return theta, None, f"RoPE type {kind!r} (only 'default' and 'llama3')"
    scaling = Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_positions=int(rope["original_max_position_embeddings"]),
    )
    return theta, scaling, None


def read_config(path: str | Path) -> LlamaConfig:
    """config.json -> ``LlamaConfig``; a ``CheckpointError`` names what is refused."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file; a model folder needs config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"{path}: not a JSON object ({error})") from error
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"{path}: a JSON {type(raw).__name__}, expected an object"
        )
    theta, scaling, rope_refused = _rope(raw)
    refused = _refusals(raw) + ([rope_refused] if rope_refused else [])
    if refused:
        raise CheckpointError(
            f"{path}: the book's Llama does not implement " + "; ".join(refused)
        )
    fields = {
        ours: raw[theirs] for theirs, ours in CONFIG_KEYS.items() if theirs in raw
    }
    if fields.get("n_kv_head") is None:  # older configs: full attention
        fields["n_kv_head"] = fields.get("n_head")
    try:
        return LlamaConfig(**fields, rope_theta=theta, rope_scaling=scaling)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: {error}") from error


def hf_config(config: LlamaConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of ``config``, in keys transformers 4 and 5 both read."""
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
    }
    raw.update({theirs: getattr(config, ours) for theirs, ours in CONFIG_KEYS.items()})
    if config.rope_scaling is not None:
        scaling = asdict(config.rope_scaling)
        raw["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": scaling["factor"],
            "low_freq_factor": scaling["low_freq_factor"],
            "high_freq_factor": scaling["high_freq_factor"],
            "original_max_position_embeddings": scaling["original_max_positions"],
        }
    return raw


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
    """A parsed model folder: its config, and every tensor by the book's name."""

    folder: Path
    config: LlamaConfig
    tensors: dict[str, StoredTensor]


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
    config = read_config(folder / "config.json")
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
    for filename in files:
        with open_safetensors(folder / filename) as handle:  # the header only
            for name in handle.keys():
                where = folder / filename
                if weight_map is not None and weight_map.get(name) != filename:
                    raise CheckpointError(
                        f"{where}: holds {name!r}, which {listing.name} places in "
                        f"{weight_map.get(name)}"
                    )
                key, header = book_key(name), handle.get_slice(name)
                if key is None or (key == "lm_head.weight" and config.tie_embeddings):
                    raise CheckpointError(
                        f"{where}: tensor {name!r} has no place in the book's Llama"
                        + (
                            " (config.json ties the head to the embedding)"
                            if key
                            else ""
                        )
                    )
                if header.get_dtype() not in DTYPES:
                    raise CheckpointError(
                        f"{where}: tensor {name!r} is {header.get_dtype()}, expected "
                        f"one of {sorted(DTYPES)}"
                    )
                shape = tuple(header.get_shape())
                tensors[key] = StoredTensor(
                    where, name, shape, DTYPES[header.get_dtype()]
                )
    unlisted = sorted(set(weight_map or {}) - {t.name for t in tensors.values()})
    if unlisted:
        raise CheckpointError(
            f"{listing}: names {unlisted[0]!r} in {weight_map[unlisted[0]]}, "
            "which does not hold it"
        )
    return HFCheckpoint(folder, config, tensors)


# ------------------------------------------------------------ apply


def load_weights(model: Llama, checkpoint: HFCheckpoint | str | Path) -> Llama:
    """Copy a checkpoint's tensors into ``model``, after checking all of them.

    The config must be ``model``'s, and every name, shape and dtype must fit
    (compared on meta tensors, which have shapes and no data); then each shard
    is opened once and its tensors copied. Nothing changes before the checks pass.
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
    shapes = {
        key: torch.empty(stored.shape, dtype=stored.dtype, device="meta")
        for key, stored in checkpoint.tensors.items()
    }
    if model.config.tie_embeddings and "token_embedding.weight" in shapes:
        shapes["lm_head.weight"] = shapes["token_embedding.weight"]  # one tensor
    check_state_dict(model, shapes, checkpoint.folder)
    targets = model.state_dict(keep_vars=True)
    by_file: dict[Path, list[str]] = {}
    for key, stored in checkpoint.tensors.items():
        by_file.setdefault(stored.file, []).append(key)
    with torch.no_grad():
        for path, keys in by_file.items():
            with open_safetensors(path) as handle:
                for key in keys:
                    targets[key].copy_(handle.get_tensor(checkpoint.tensors[key].name))
    return model


def load_pretrained(
    folder: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> Llama:
    """Build the book's Llama from a model folder, in the weights' dtype or ``dtype``.

    The model is built on the meta device and given uninitialised memory
    (``to_empty``), so no random initialisation is computed and then overwritten.
    """
    checkpoint = read_checkpoint(folder)
    with torch.device("meta"):
        model = Llama(checkpoint.config)
    stored = checkpoint.tensors.get("token_embedding.weight")
    model = model.to(stored.dtype if stored else torch.float32).to_empty(device=device)
    if model.config.tie_embeddings:  # to_empty gives each name its own new tensor
        model.lm_head.weight = model.token_embedding.weight
    load_weights(model, checkpoint)
    return model if dtype is None else model.to(dtype)


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
    """Save ``model`` as a Hugging Face folder: config.json, shards and their index.

    The shards come first and the index last (``save_sharded_safetensors``),
    so an interrupted save leaves no index that names missing shards.
    """
    folder = Path(folder)
    try:
        tensors = hf_state_dict(model)
    except CheckpointError as error:
        raise CheckpointError(f"{folder}: not written; {error}") from error
    dtype = model.token_embedding.weight.dtype
    atomic_write_text(
        folder / "config.json",
        json.dumps(hf_config(model.config, dtype), indent=2) + "\n",
    )
    save_sharded_safetensors(tensors, folder, max_shard_bytes)
    return folder
