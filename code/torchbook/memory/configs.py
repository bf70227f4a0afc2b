"""A model's shape read from its config.json, and its exact parameter count.

The memory calculator (``python -m torchbook.memory --config config.json``)
needs a model's shape, not its weights: the widths of its matrices, how many
heads share a key/value head, whether the head reuses the embedding. This
module reads that from a Hugging Face ``config.json`` into an ``Architecture``,
for the families it knows:

- ``llama``: RMSNorm, grouped-query attention with RoPE, a SwiGLU MLP (gate,
  up and down matrices), an untied head unless ``tie_word_embeddings``. Llama
  3's ``rope_scaling`` changes the angles, not a single tensor's size;
- ``mistral``: Llama's layout (Mistral 7B v0.1 adds a sliding attention
  window, which changes the mask, not the weights);
- ``qwen2``: Llama's layout with biases on the q, k and v projections;
- ``gpt2``: LayerNorm with bias, one fused q/k/v matrix, a 4x GELU MLP with
  biases, learned position embeddings, the head tied to the embedding;
- the book's GPT (``torchbook.models.GPTConfig``'s fields: GPT-2's layout with
  RoPE instead of learned positions) and the book's Llama
  (``torchbook.llama.LlamaConfig``'s fields, read as a ``llama`` config).

Absent keys take the value transformers' config class gives them (the tests
build each family's model from a minimal dict and compare the counts). Each
field read is checked for its kind (a positive integer, true or false, a
rate), and a wrong one is refused with the file and the field's name: zero
key/value heads, which transformers cannot build, are not read as absent. An
unknown ``model_type`` is refused with the list of known ones. Nothing here
imports torch: the calculator answers in well under the two seconds that
importing torch alone can take.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "torchbook-gpt")
# The keys a family's config.json must have: the sizes nothing can default.
HF_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
REQUIRED = {
    **{family: (*HF_SIZES, "num_attention_heads") for family in FAMILIES[:3]},
    "gpt2": ("vocab_size", "n_embd", "n_layer", "n_head"),
    "torchbook-gpt": ("vocab_size", "n_layer", "n_head", "d_model"),
}
# The book's own configs carry no model_type: they are told apart by their fields.
BOOK_GPT_FIELDS = {"vocab_size", "block_size", "n_layer", "n_head", "d_model"}
BOOK_LLAMA_FIELDS = {"vocab_size", "n_layer", "n_head", "n_kv_head", "d_model"}
BOOK_LLAMA_REQUIRED = (*sorted(BOOK_LLAMA_FIELDS), "mlp_size")
REQUIRED_FIELD = object()  # a field with no default: absent or null is an error
# transformers' default key/value heads where a config has none (None: all heads)
KV_HEADS = {"llama": None, "mistral": 8, "qwen2": 32}
# The flags that override a config's fields, and each family's name for the field.
OVERRIDES = {
    "layers": {"hf": "num_hidden_layers", "gpt2": "n_layer", "book": "n_layer"},
    "width": {"hf": "hidden_size", "gpt2": "n_embd", "book": "d_model"},
    "heads": {"hf": "num_attention_heads", "gpt2": "n_head", "book": "n_head"},
    "kv_heads": {"hf": "num_key_value_heads", "book": "n_kv_head"},
    "ffn": {"hf": "intermediate_size", "gpt2": "n_inner", "book": "mlp_size"},
    "vocab": {"hf": "vocab_size", "gpt2": "vocab_size", "book": "vocab_size"},
}


@dataclass(frozen=True)
class Projection:
    """One matrix of a block: its name (as peft targets it), sizes and bias."""

    name: str  # the module's own name: "q_proj", "c_attn", ...
    in_features: int
    out_features: int
    bias: bool
    fed_by_norm: bool  # its input is a norm's output (else a 16-bit matmul's)

    @property
    def parameters(self) -> int:
        return self.in_features * self.out_features + self.out_features * self.bias


@dataclass(frozen=True)
class Architecture:
    """The sizes a model's memory depends on, in transformers' own terms."""

    family: str  # one of FAMILIES
    vocab_size: int
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    tied_embeddings: bool
    qkv_bias: bool = False
    output_bias: bool = False  # Llama's attention_bias also gives o_proj one
    mlp_bias: bool = False
    positions: int = 0  # learned position embeddings (GPT-2); 0: RoPE
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0  # GPT-2's resid_pdrop, after each projection
    embedding_dropout: float = 0.0
    sliding_window: int | None = None  # Mistral 7B v0.1's attention window

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "hidden_size", "layers", "heads", "kv_heads")
        for name in (*sizes, "head_dim", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads} "
                "(each key/value head serves a group of query heads)"
            )
        if self.gated is False and self.heads * self.head_dim != self.hidden_size:
            raise ValueError(
                f"width {self.hidden_size} must be divisible by heads={self.heads} "
                f"(GPT-2's fused q/k/v matrix is width x 3 width)"
            )
        if self.positions == 0 and self.head_dim % 2:
            raise ValueError(
                f"head size {self.head_dim} must be even: RoPE rotates pairs"
            )

    @property
    def gated(self) -> bool:
        """A SwiGLU MLP (gate, up, down) and RMSNorm, as Llama; else GPT-2's."""
        return self.family in ("llama", "mistral", "qwen2")

    @property
    def norm_parameters(self) -> int:
        """One norm's parameters: RMSNorm a weight, LayerNorm a weight and a bias."""
        return self.hidden_size * (1 if self.gated else 2)

    def projections(self) -> tuple[Projection, ...]:
        """A block's matrices in the order its forward pass uses them."""
        width, ffn = self.hidden_size, self.intermediate_size
        if not self.gated:  # GPT-2 and the book's GPT: every matrix has a bias
            return (
                Projection("c_attn", width, 3 * width, True, True),
                Projection("c_proj", width, width, True, False),
                Projection("c_fc", width, ffn, True, True),
                Projection("c_proj", ffn, width, True, False),
            )
        queries, keys = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (
            Projection("q_proj", width, queries, self.qkv_bias, True),
            Projection("k_proj", width, keys, self.qkv_bias, True),
            Projection("v_proj", width, keys, self.qkv_bias, True),
            Projection("o_proj", queries, width, self.output_bias, False),
            Projection("gate_proj", width, ffn, self.mlp_bias, True),
            Projection("up_proj", width, ffn, self.mlp_bias, True),
            Projection("down_proj", ffn, width, self.mlp_bias, False),
        )

    def block_parameters(self) -> int:
        """Parameters of one block: two norms and the projections."""
        return 2 * self.norm_parameters + sum(p.parameters for p in self.projections())

    def outside_parameters(self) -> int:
        """Parameters outside the blocks: embeddings, final norm, an untied head."""
        embeddings = (self.vocab_size + self.positions) * self.hidden_size
        head = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return embeddings + self.norm_parameters + head

    def parameter_count(self) -> int:
        """Every parameter, the tied matrix once: what ``model.parameters()`` sums."""
        return self.layers * self.block_parameters() + self.outside_parameters()

    def parameter_tensors(self) -> int:
        """Parameter tensors: AdamW keeps one step counter for each."""
        norm = 1 if self.gated else 2
        block = 2 * norm + sum(1 + p.bias for p in self.projections())
        outside = 1 + (self.positions > 0) + norm + (not self.tied_embeddings)
        return self.layers * block + outside


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A config.json as a dict, or an error naming the file and what was expected."""
    path = Path(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"{path}: no such file (expected a model's config.json)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: holds a JSON {type(config).__name__}, not an object")
    return config


def read_architecture(
    path: str | Path, overrides: Mapping[str, int | None] | None = None
) -> Architecture:
    """The ``Architecture`` of a config.json, with flags' overrides; errors name it."""
    config = read_config_json(path)
    return architecture(with_overrides(config, overrides or {}, str(path)), str(path))


def family_of(config: Mapping[str, Any], source: str = "config") -> str:
    """The family of a config dict: its ``model_type``, or the book's by its fields."""
    model_type = config.get("model_type")
    if model_type is None and BOOK_LLAMA_FIELDS <= config.keys():
        return "llama"  # the book's LlamaConfig: read as a Llama
    if model_type is None and BOOK_GPT_FIELDS <= config.keys():
        return "torchbook-gpt"
    if model_type not in FAMILIES:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not one the calculator knows; "
            f"known: {', '.join(FAMILIES)} (and the book's GPTConfig and LlamaConfig "
            "fields). For another architecture, run its training step on fake "
            "tensors instead (torchbook.memory.tracker.fake_step_peak)"
        )
    return model_type


def with_overrides(
    config: Mapping[str, Any],
    overrides: Mapping[str, int | None],
    source: str = "config",
) -> dict[str, Any]:
    """``config`` with the flags that were given (not None) written into its fields."""
    family = family_of(config, source)
    book = family == "torchbook-gpt" or "n_kv_head" in config
    style = "book" if book else "gpt2" if family == "gpt2" else "hf"
    changed = dict(config)
    for flag, value in overrides.items():
        if value is None:
            continue
        key = OVERRIDES[flag].get(style)
        if key is None:
            raise ValueError(f"--{flag.replace('_', '-')} does not apply to {family}")
        changed[key] = value
    return changed


class _Fields:
    """A config's fields read one by one, each checked for its kind of value.

    transformers' config classes accept any JSON and fail later, inside the
    model (a string width) or never (zero key/value heads read as "absent"),
    so each field the calculator reads is checked here, by name.
    """

    EXPECTED = {
        "size": "a positive integer",
        "flag": "true or false",
        "rate": "a number in [0, 1)",
    }

    def __init__(self, config: Mapping[str, Any], source: str) -> None:
        self.config, self.source = config, source

    def get(self, key: str, kind: str = "size", default: Any = REQUIRED_FIELD) -> Any:
        """``config[key]`` checked to be ``kind``; ``default`` if absent or null."""
        value = self.config.get(key)
        if value is None and default is not REQUIRED_FIELD:
            return default
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        valid = {
            "size": number and isinstance(value, int) and value >= 1,
            "flag": isinstance(value, bool),
            "rate": number and 0 <= value < 1,
        }[kind]
        if not valid:
            raise ValueError(
                f"{self.source}: {key} must be {self.EXPECTED[kind]}, got {value!r}"
            )
        return value


def architecture(config: Mapping[str, Any], source: str = "config") -> Architecture:
    """An ``Architecture`` from a config dict (Hugging Face's, or the book's fields).

    Errors name ``source`` (the file) and the field: a missing size, a value
    of the wrong kind, or sizes that cannot make a model.
    """
    family = family_of(config, source)
    book_llama = family != "torchbook-gpt" and "n_kv_head" in config
    required = BOOK_LLAMA_REQUIRED if book_llama else REQUIRED[family]
    missing = [key for key in required if key not in config]
    if missing:
        raise ValueError(f"{source}: {family} config has no {', '.join(missing)}")
    fields = _Fields(config, source)
    try:
        if book_llama:
            return _book_llama(fields)
        if family == "gpt2":
            return _gpt2(fields)
        if family == "torchbook-gpt":
            return _book_gpt(fields)
        return _hugging_face(family, fields)
    except ValueError as error:
        message = str(error)
        raise ValueError(
            message if message.startswith(source) else f"{source}: {message}"
        ) from None


def _hugging_face(family: str, fields: _Fields) -> Architecture:
    """Llama, Mistral and Qwen2: transformers' names, and its defaults when absent."""
    heads, width = fields.get("num_attention_heads"), fields.get("hidden_size")
    window = None  # Mistral's default window is 4,096; Qwen2 uses one only if asked
    if family == "mistral" or fields.get("use_sliding_window", "flag", False):
        window = fields.get("sliding_window", "size", None)
        if family == "mistral" and "sliding_window" not in fields.config:
            window = 4096
    # absent: the family's default; null: every query head has its own
    kv_default = (
        KV_HEADS[family] if "num_key_value_heads" not in fields.config else None
    )
    attention_bias = fields.get("attention_bias", "flag", False)
    return Architecture(
        family,
        fields.get("vocab_size"),
        width,
        fields.get("num_hidden_layers"),
        heads,
        fields.get("num_key_value_heads", "size", kv_default or heads),
        fields.get("head_dim", "size", width // heads),
        fields.get("intermediate_size"),
        tied_embeddings=fields.get("tie_word_embeddings", "flag", False),
        qkv_bias=family == "qwen2" or attention_bias,
        output_bias=family == "llama" and attention_bias,
        mlp_bias=family == "llama" and fields.get("mlp_bias", "flag", False),
        attention_dropout=fields.get("attention_dropout", "rate", 0.0),
        sliding_window=window,
    )


def _book_gpt(fields: _Fields) -> Architecture:
    """The book's ``GPTConfig`` fields (``torchbook.models``): GPT-2's layout, RoPE."""
    width, heads = fields.get("d_model"), fields.get("n_head")
    dropout = fields.get("dropout", "rate", 0.0)
    return Architecture(
        "torchbook-gpt",
        fields.get("vocab_size"),
        width,
        fields.get("n_layer"),
        heads,
        heads,
        width // heads,
        4 * width,  # models.MLP_EXPANSION
        tied_embeddings=True,
        qkv_bias=True,
        attention_dropout=dropout,
        residual_dropout=dropout,
        embedding_dropout=dropout,
    )


def _gpt2(fields: _Fields) -> Architecture:
    """GPT-2's names: n_embd, n_layer, n_head, n_inner (None: 4 x n_embd), *_pdrop."""
    width, heads = fields.get("n_embd"), fields.get("n_head")
    return Architecture(
        "gpt2",
        fields.get("vocab_size"),
        width,
        fields.get("n_layer"),
        heads,
        heads,
        width // heads,
        fields.get("n_inner", "size", 4 * width),
        tied_embeddings=fields.get("tie_word_embeddings", "flag", True),
        qkv_bias=True,
        positions=fields.get("n_positions", "size", 1024),
        attention_dropout=fields.get("attn_pdrop", "rate", 0.1),
        residual_dropout=fields.get("resid_pdrop", "rate", 0.1),
        embedding_dropout=fields.get("embd_pdrop", "rate", 0.1),
    )


def _book_llama(fields: _Fields) -> Architecture:
    """The book's ``LlamaConfig`` fields (``torchbook.llama``), as a ``llama``."""
    width, heads = fields.get("d_model"), fields.get("n_head")
    return Architecture(
        "llama",
        fields.get("vocab_size"),
        width,
        fields.get("n_layer"),
        heads,
        fields.get("n_kv_head"),
        fields.get("head_size", "size", width // heads),
        fields.get("mlp_size"),
        tied_embeddings=fields.get("tie_embeddings", "flag", False),
    )


def to_transformers_config(arch: Architecture) -> dict[str, Any]:
    """A transformers config dict for ``arch``: what the fake-tensor check builds."""
    if arch.family == "torchbook-gpt":
        raise ValueError("the book's GPT has no transformers config")
    if arch.family == "gpt2":
        return {
            "model_type": "gpt2",
            "vocab_size": arch.vocab_size,
            "n_embd": arch.hidden_size,
            "n_layer": arch.layers,
            "n_head": arch.heads,
            "n_inner": arch.intermediate_size,
            "n_positions": arch.positions,
            "attn_pdrop": arch.attention_dropout,
            "resid_pdrop": arch.residual_dropout,
            "embd_pdrop": arch.embedding_dropout,
            "tie_word_embeddings": arch.tied_embeddings,
        }
    config = {
        "model_type": arch.family,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "num_hidden_layers": arch.layers,
        "num_attention_heads": arch.heads,
        "num_key_value_heads": arch.kv_heads,
        "head_dim": arch.head_dim,
        "intermediate_size": arch.intermediate_size,
        "tie_word_embeddings": arch.tied_embeddings,
        "attention_dropout": arch.attention_dropout,
    }
    if arch.family == "llama":
        config["attention_bias"] = arch.qkv_bias
        config["mlp_bias"] = arch.mlp_bias
    if arch.family == "mistral":
        config["sliding_window"] = arch.sliding_window
    return config
