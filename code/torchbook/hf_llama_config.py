"""config.json of a Llama: read into the book's ``LlamaConfig``, and written back.

Every field of transformers' ``LlamaConfig`` has one of four fates here:

- **read**: ``CONFIG_KEYS`` names the ``LlamaConfig`` field each fills; the
  RoPE fields (``ROPE_FIELDS``) give the base and Llama 3's scaling, read as
  transformers 5 reads them; ``DTYPE_FIELDS`` name the dtype to load in;
- **checked** (``CHECKED_FIELDS``): refused by name unless at a value the
  book's module computes, since it would compute something else: another
  ``model_type`` or activation, biases, attention dropout, and, from other
  families, a sliding window or quantized weights;
- **ignored** by name (``IGNORED_FIELDS``), each with the reason it changes
  nothing the model computes;
- a field transformers' ``LlamaConfig`` does not define is ignored, as
  transformers' Llama ignores it, unless ``CHECKED_FIELDS`` names it.

``config_json`` and ``generation_config_json`` write the two files back as
``save_pretrained`` does, in keys both transformers 4 and 5 read.

It builds on ``torchbook.llama`` (the config it fills) and
``torchbook.state_dicts`` (the error every refusal raises).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from torchbook.llama import Llama3RopeScaling, LlamaConfig
from torchbook.state_dicts import CheckpointError

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
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id",
}
# Read by _rope: transformers 5's rope_parameters, or 4's rope_theta and rope_scaling.
ROPE_FIELDS = ("rope_parameters", "rope_theta", "rope_scaling")
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor")  # required
# The dtype load_pretrained builds in by default (transformers 5's name, then 4's).
DTYPE_FIELDS = ("dtype", "torch_dtype")
# Refused unless at a value the book's Llama computes: field -> (values, why).
CHECKED_FIELDS = {
    "model_type": (("llama",), "only 'llama' is implemented"),
    "hidden_act": (("silu", "swish"), "SwiGLU here uses SiLU, which is 'swish'"),
    "attention_bias": ((False, None), "the module's linear layers have no bias"),
    "mlp_bias": ((False, None), "the module's linear layers have no bias"),
    "attention_dropout": (
        (0, None),
        "transformers drops attention weights in training; the module has no dropout",
    ),
    "sliding_window": ((None,), "attention here sees the whole past"),
    "quantization_config": ((None,), "quantized weights are not dequantized here"),
}
# Ignored, because it changes nothing the model computes: field -> why.
IGNORED_FIELDS = {
    "initializer_range": "the random start of a new model; these weights are loaded",
    "use_cache": "whether generation keeps a KV cache; the logits are the same",
    "pretraining_tp": "how Meta split matmuls across GPUs; transformers 5 ignores it",
    "architectures": "the name of the class transformers builds",
    "transformers_version": "the version that wrote the file",
    "return_dict": "how transformers returns its outputs",
    "output_hidden_states": "how transformers returns its outputs",
    "chunk_size_feed_forward": "an option of other models; Llama does not read it",
    "is_encoder_decoder": "an option of other models; Llama does not read it",
    "id2label": "the labels of a classification head, which a causal LM lacks",
    "label2id": "the labels of a classification head, which a causal LM lacks",
    "problem_type": "the loss of a classification head, which a causal LM lacks",
}

# config.json's names for the floating-point dtypes a Llama's weights come in.
DTYPE_NAMES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _refusals(raw: dict[str, Any]) -> list[str]:
    """What ``raw`` asks for that the book's Llama does not compute, in words."""
    refused = []
    for field, (computed, why) in CHECKED_FIELDS.items():
        value = raw.get(field, computed[0])
        if value not in computed:
            refused.append(f"{field} {value!r} ({why})")
    return refused


def _rope(
    raw: dict[str, Any], path: Path
) -> tuple[float, Llama3RopeScaling | None, str | None]:
    """RoPE's base and scaling, read as transformers 5 reads them.

    A ``rope_scaling`` block (version 4's spelling) wins over ``rope_parameters``
    (5's) when both are set, and the base comes from that block, else from
    ``rope_theta``. The third value names a refused RoPE type (None: accepted).
    """
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    rope = raw.get(field) or {}
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None, None
    if kind != "llama3":
        return theta, None, f"{field}: RoPE type {kind!r} (only 'default' and 'llama3')"
    missing = [name for name in LLAMA3_ROPE if name not in rope]
    if missing:
        raise CheckpointError(
            f"{path}: field {field!r} has rope_type 'llama3' but no "
            + ", ".join(missing)
        )
    scaling = Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        # transformers' default: the context the config gives
        original_max_positions=int(
            rope.get(
                "original_max_position_embeddings",
                raw.get("max_position_embeddings", LlamaConfig.max_positions),
            )
        ),
    )
    return theta, scaling, None


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; a ``CheckpointError`` names the file otherwise."""
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
    return raw


def read_llama_config(path: str | Path) -> LlamaConfig:
    """config.json -> ``LlamaConfig``; a ``CheckpointError`` names what is refused."""
    path = Path(path)
    raw = _read_json(path)
    theta, scaling, rope_refused = _rope(raw, path)
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


def config_json(config: LlamaConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of ``config``, in keys transformers 4 and 5 both read."""
    dtype_name = str(dtype).removeprefix("torch.")
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
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


def config_dtype(path: str | Path) -> torch.dtype | None:
    """The dtype config.json names for the weights (transformers 5's field, or 4's)."""
    raw = _read_json(Path(path))
    named = [raw[field] for field in DTYPE_FIELDS if raw.get(field) in DTYPE_NAMES]
    return DTYPE_NAMES[named[0]] if named else None


def generation_config_json(config: LlamaConfig) -> dict[str, Any]:
    """The generation_config.json save_pretrained derives from a model's config."""
    tokens = {
        name: getattr(config, name)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id")
        if getattr(config, name) is not None
    }
    return {"_from_model_config": True, **tokens}
