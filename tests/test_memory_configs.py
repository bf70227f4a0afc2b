"""Architectures read from config.json, and their parameters counted exactly."""

from __future__ import annotations

import json

import pytest
import torch

from torchbook.memory.configs import (
    FAMILIES,
    architecture,
    read_config_json,
    to_transformers_config,
    with_overrides,
)

LLAMA3_ROPE = {  # Llama 3.1 and later: rescaled RoPE frequencies
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
# The shapes of the public config.json files (Hugging Face hub), written out:
# the tests run offline.
REAL_CONFIGS = {
    "Llama-3.2-1B": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3_ROPE,
        "rms_norm_eps": 1e-05,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
    },
    "Llama-3-8B": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
    },
    "Mistral-7B-v0.1": {
        "model_type": "mistral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
    },
    "Qwen2.5-0.5B": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
    },
    "Qwen2.5-7B": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    },
    "gpt2": {
        "model_type": "gpt2",
        "vocab_size": 50257,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_positions": 1024,
        "n_ctx": 1024,
    },
    "gpt2-xl": {
        "model_type": "gpt2",
        "vocab_size": 50257,
        "n_embd": 1600,
        "n_layer": 48,
        "n_head": 25,
        "n_positions": 1024,
        "n_ctx": 1024,
    },
}


def transformers_count(config: dict) -> int:
    """Parameters of transformers' own causal LM for ``config``, built on meta."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    hf = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_parameters_equal_transformers_model_built_on_meta(name):
    config = REAL_CONFIGS[name]
    # Exact: the same matrices, biases and norms, the tied matrix once.
    assert architecture(config, name).parameter_count() == transformers_count(config)


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "llama", "vocab_size": 512, "hidden_size": 128},
        {"model_type": "mistral", "vocab_size": 512, "hidden_size": 128},
        {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 128},
        {"model_type": "gpt2", "vocab_size": 512, "n_embd": 64, "n_head": 4},
    ],
    ids=lambda config: config["model_type"],
)
def test_absent_keys_take_transformers_defaults(config):
    # 32 heads: each family's default key/value heads (all, 8, 32) divides them
    sizes = {"intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 32}
    if config["model_type"] == "gpt2":
        sizes = {"n_layer": 2}
    # only the keys a config cannot do without: the defaults of tying, key/value
    # heads, head size, biases and positions are transformers' (or a wrong count)
    minimal = {**config, **sizes}
    assert architecture(minimal).parameter_count() == transformers_count(minimal)


def test_the_check_builds_the_same_model_from_the_architecture():
    arch = architecture(REAL_CONFIGS["Qwen2.5-0.5B"])
    assert transformers_count(to_transformers_config(arch)) == arch.parameter_count()


def test_llama3_rope_scaling_changes_no_parameter():
    scaled = REAL_CONFIGS["Llama-3.2-1B"]
    plain = {key: value for key, value in scaled.items() if key != "rope_scaling"}
    assert architecture(scaled) == architecture(plain)


def test_the_books_gpt_config_counts_the_books_gpt():
    from torchbook.memory.gpt import parameter_count
    from torchbook.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, d_model=32)
    fields = {name: getattr(config, name) for name in config.__dataclass_fields__}
    arch = architecture(fields)  # the book's fields, no model_type
    with torch.device("meta"):
        model = GPT(config)
    assert arch.family == "torchbook-gpt"
    assert arch.parameter_count() == sum(p.numel() for p in model.parameters())
    assert arch.parameter_count() == parameter_count(config)


@pytest.mark.parametrize("tied", [True, False])
def test_the_books_llama_config_counts_the_books_llama(tied):
    from torchbook.llama import Llama, LlamaConfig

    config = LlamaConfig(
        vocab_size=96,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        d_model=32,
        mlp_size=80,
        tie_embeddings=tied,
    )
    fields = {name: getattr(config, name) for name in config.__dataclass_fields__}
    with torch.device("meta"):
        model = Llama(config)
    arch = architecture(fields)
    assert arch.family == "llama"  # read as transformers' Llama
    assert arch.parameter_count() == sum(p.numel() for p in model.parameters())


def test_an_unknown_model_type_is_refused_with_the_known_ones():
    with pytest.raises(ValueError) as error:
        architecture({"model_type": "falcon", "vocab_size": 8}, "falcon/config.json")
    message = str(error.value)
    assert "falcon/config.json: model_type 'falcon'" in message
    assert all(family in message for family in FAMILIES)


def test_a_missing_size_is_refused_with_its_key_and_file():
    with pytest.raises(
        ValueError, match="c.json: llama config has no intermediate_size"
    ):
        architecture(
            {
                "model_type": "llama",
                "vocab_size": 8,
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            },
            "c.json",
        )


def test_flags_override_the_configs_fields():
    config = REAL_CONFIGS["Llama-3-8B"]
    changed = architecture(with_overrides(config, {"layers": 2, "kv_heads": 32}))
    assert (changed.layers, changed.kv_heads) == (2, 32)
    assert changed.hidden_size == architecture(config).hidden_size
    gpt2 = architecture(with_overrides(REAL_CONFIGS["gpt2"], {"width": 960}))
    assert gpt2.hidden_size == 960  # GPT-2 names it n_embd
    with pytest.raises(ValueError, match="--kv-heads does not apply to gpt2"):
        with_overrides(REAL_CONFIGS["gpt2"], {"kv_heads": 4})


def test_impossible_shapes_are_refused_by_name():
    config = REAL_CONFIGS["Llama-3-8B"]
    with pytest.raises(ValueError, match="heads=32 must be a multiple of kv_heads=5"):
        architecture(with_overrides(config, {"kv_heads": 5}))
    with pytest.raises(
        ValueError, match="num_hidden_layers must be a positive integer, got 0"
    ):
        architecture(with_overrides(config, {"layers": 0}))


def test_a_file_that_is_no_config_is_refused_with_its_path(tmp_path):
    missing = tmp_path / "nothing.json"
    with pytest.raises(ValueError, match="nothing.json: no such file"):
        read_config_json(missing)
    broken = tmp_path / "broken.json"
    broken.write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match="broken.json: not JSON"):
        read_config_json(broken)
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([1, 2]), encoding="utf-8")
    with pytest.raises(ValueError, match="list.json: holds a JSON list"):
        read_config_json(listed)


SMALL_LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
}


def test_null_key_value_heads_are_the_query_heads_as_in_transformers():
    config = {**SMALL_LLAMA, "num_key_value_heads": None}
    assert architecture(config).kv_heads == 4
    assert architecture(config).parameter_count() == transformers_count(config)


def test_zero_key_value_heads_are_refused_as_transformers_refuses_them():
    config = {**SMALL_LLAMA, "num_key_value_heads": 0}
    with pytest.raises(ZeroDivisionError):  # transformers cannot build it
        transformers_count(config)
    with pytest.raises(ValueError, match="c.json: num_key_value_heads must be a pos"):
        architecture(config, "c.json")
