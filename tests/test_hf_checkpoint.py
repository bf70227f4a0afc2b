"""code/torchbook/hf_checkpoint.py: Hugging Face folders into the book's Llama and back.

The reference is transformers' own ``LlamaForCausalLM``: a folder it saves loads
into the book's module with its logits and its greedy tokens, every refusal
names the file and the key, and what the book saves transformers loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers

from tests.tensor_checks import assert_same_tensors, snapshot
from torchbook import hf_checkpoint
from torchbook.hf_checkpoint import (
    CheckpointError,
    load_pretrained,
    load_weights,
    read_checkpoint,
    save_hf_folder,
)
from torchbook.llama import Llama, LlamaConfig

VOCAB, LAYERS, HEADS, WIDTH, MLP = 64, 2, 4, 32, 48
ROPE_THETA = 500_000.0  # not the default, so a loader that ignores it fails
SHARD_BYTES = 20_000  # a few tensors per shard: the folder is sharded with an index
# float32 logits of about 1: both implementations run the same operations, and
# where their order differs (grouped keys repeated or read in place) the sums
# round differently by a few float32 ulps (1.2e-7) per layer; 1e-5 is far above
# that and far below any real difference (a wrong weight moves logits by ~0.1).
ATOL = RTOL = 1e-5


def hf_llama(
    n_kv_head: int = 2, tied: bool = False, seed: int = 0, **extra
) -> transformers.LlamaForCausalLM:
    """A tiny random transformers Llama, its weights large enough for clear argmaxes."""
    torch.manual_seed(seed)
    rope = extra.pop("rope_parameters", {"rope_type": "default"})
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=n_kv_head,
        max_position_embeddings=64,
        rope_parameters={**rope, "rope_theta": ROPE_THETA},
        tie_word_embeddings=tied,
        initializer_range=0.2,
        **extra,
    )
    return transformers.LlamaForCausalLM(config).eval()


def saved(model: transformers.LlamaForCausalLM, folder: Path) -> Path:
    model.save_pretrained(folder, max_shard_size=SHARD_BYTES)
    return folder


@pytest.fixture
def folder(tmp_path) -> Path:
    """A sharded folder saved by transformers (grouped-query attention, untied head)."""
    return saved(hf_llama(), tmp_path / "llama")


def prompt(length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(
        VOCAB, (2, length), generator=torch.Generator().manual_seed(seed)
    )


def shard_of(folder: Path, name: str) -> Path:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / index["weight_map"][name]


def rewrite_shard(path: Path, change) -> None:
    """Load a shard's tensors, let ``change`` edit the dict, write it back."""
    tensors = safetensors.torch.load_file(path)
    change(tensors)
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})


def edit_index(folder: Path, change) -> None:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    change(index["weight_map"])
    path.write_text(json.dumps(index))


# ------------------------------------------------------------ against transformers


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("n_kv_head", [2, HEADS], ids=["grouped-query", "full"])
def test_the_book_llama_gives_transformers_logits_and_greedy_tokens(
    tmp_path, n_kv_head, tied
):
    reference = hf_llama(n_kv_head, tied)
    folder = saved(reference, tmp_path / "llama")
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1

    model = load_pretrained(folder).eval()

    assert (model.lm_head.weight is model.token_embedding.weight) == tied
    idx = prompt()
    with torch.no_grad():
        torch.testing.assert_close(
            model(idx), reference(idx).logits, atol=ATOL, rtol=RTOL
        )
    reference.generation_config.eos_token_id = None  # all max_new_tokens, no stop
    expected = reference.generate(
        idx[:, :4], max_new_tokens=16, do_sample=False, pad_token_id=0
    )
    assert torch.equal(model.generate(idx[:, :4], max_new_tokens=16), expected)


def test_llama3_rope_scaling_gives_transformers_logits(tmp_path):
    # original context 32 positions: the scaling changes rotations a 60-token
    # prompt uses (slowed, kept and interpolated pairs)
    rope = {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    reference = hf_llama(rope_parameters=rope)
    model = load_pretrained(saved(reference, tmp_path / "llama3")).eval()
    assert model.config.rope_scaling is not None
    idx = prompt(60)
    with torch.no_grad():
        torch.testing.assert_close(
            model(idx), reference(idx).logits, atol=ATOL, rtol=RTOL
        )


def test_the_key_map_names_every_transformers_tensor_both_ways():
    for tied in (False, True):
        reference = hf_llama(tied=tied)
        hf_keys = set(reference.state_dict()) - ({"lm_head.weight"} if tied else set())
        config = read_config_of(reference)
        book = Llama(config)
        assert set(hf_checkpoint.hf_state_dict(book)) == hf_keys
        assert {hf_checkpoint.book_key(k) for k in hf_keys} <= set(book.state_dict())


def read_config_of(model: transformers.LlamaForCausalLM) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        n_layer=LAYERS,
        n_head=HEADS,
        n_kv_head=model.config.num_key_value_heads,
        d_model=WIDTH,
        mlp_size=MLP,
        max_positions=64,
        rope_theta=ROPE_THETA,
        tie_embeddings=model.config.tie_word_embeddings,
    )


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformers_loads_what_the_book_saves_with_the_same_logits(tmp_path, tied):
    torch.manual_seed(3)
    config = read_config_of(hf_llama(tied=tied))
    model = Llama(config).eval()
    folder = save_hf_folder(model, tmp_path / "saved", max_shard_bytes=SHARD_BYTES)
    assert (folder / "model.safetensors.index.json").is_file()

    loaded = transformers.LlamaForCausalLM.from_pretrained(folder).eval()

    idx = prompt()
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx).logits, model(idx), atol=ATOL, rtol=RTOL)
    assert_same_tensors(snapshot(load_pretrained(folder)), snapshot(model))


def test_a_bf16_folder_loads_in_bf16_or_in_the_dtype_asked_for(tmp_path):
    reference = hf_llama().to(torch.bfloat16)
    folder = saved(reference, tmp_path / "bf16")
    assert load_pretrained(folder).lm_head.weight.dtype == torch.bfloat16
    model = load_pretrained(folder, dtype=torch.float32)
    assert model.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight.float())


def test_one_unsharded_file_loads_too(tmp_path):
    reference = hf_llama()
    reference.save_pretrained(tmp_path / "one")
    assert (tmp_path / "one" / "model.safetensors").is_file()
    model = load_pretrained(tmp_path / "one")
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)


# ------------------------------------------------------------ refusals, by name


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("model_type", "mistral", "model_type 'mistral'"),
        ("attention_bias", True, "attention_bias"),
        ("mlp_bias", True, "mlp_bias"),
        ("sliding_window", 4096, "sliding_window 4096"),
        ("hidden_act", "gelu", "hidden_act 'gelu'"),
        ("quantization_config", {"quant_method": "bitsandbytes"}, "quantization"),
        (
            "rope_parameters",
            {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            "RoPE type 'linear'",
        ),
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "RoPE type 'dynamic'"),
    ],
)
def test_a_setting_the_module_does_not_implement_is_refused_by_name(
    folder, field, value, named
):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    if field == "rope_scaling":  # transformers 4's spelling
        raw.pop("rope_parameters")
    raw[field] = value
    path.write_text(json.dumps(raw))
    model = Llama(read_config_of(hf_llama()))
    before = snapshot(model)

    with pytest.raises(CheckpointError, match=str(path)) as refused:
        load_weights(model, folder)

    assert named in str(refused.value)
    assert_same_tensors(snapshot(model), before)


def refused_and_unchanged(folder: Path) -> str:
    """The error loading ``folder`` raises; asserts the model was not changed."""
    model = Llama(read_config_of(hf_llama()))
    before = snapshot(model)
    with pytest.raises(CheckpointError) as refused:
        load_weights(model, folder)
    assert_same_tensors(snapshot(model), before)
    return str(refused.value)


def test_a_missing_shard_is_refused_with_the_index_and_the_shard_named(folder):
    shard = shard_of(folder, "model.layers.1.mlp.up_proj.weight")
    shard.unlink()
    message = refused_and_unchanged(folder)
    assert "model.safetensors.index.json" in message and shard.name in message


def test_an_unknown_key_is_refused_with_its_file_and_name(folder):
    name = "model.layers.0.self_attn.q_proj.weight"
    shard = shard_of(folder, name)
    bias = "model.layers.0.self_attn.q_proj.bias"
    rewrite_shard(shard, lambda tensors: tensors.update({bias: torch.zeros(WIDTH)}))
    edit_index(folder, lambda weight_map: weight_map.update({bias: shard.name}))
    message = refused_and_unchanged(folder)
    assert str(shard) in message and bias in message


def test_a_missing_key_is_refused_by_name(folder):
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_shard(shard_of(folder, name), lambda tensors: tensors.pop(name))
    edit_index(folder, lambda weight_map: weight_map.pop(name))
    message = refused_and_unchanged(folder)
    assert str(folder) in message and "missing keys: blocks.1.mlp.up.weight" in message


def test_a_wrong_shape_is_refused_with_both_shapes(folder):
    name = "model.layers.0.self_attn.k_proj.weight"
    rewrite_shard(
        shard_of(folder, name),
        lambda tensors: tensors.update({name: torch.zeros(8, 8)}),
    )
    message = refused_and_unchanged(folder)
    assert "blocks.0.attn.key.weight" in message
    assert "(8, 8) in the file" in message and "(16, 32) in the model" in message


def test_a_key_the_index_places_in_another_shard_is_refused(folder):
    name = "model.norm.weight"
    other = next(p.name for p in folder.glob("model-*") if p != shard_of(folder, name))
    edit_index(folder, lambda weight_map: weight_map.update({name: other}))
    message = refused_and_unchanged(folder)
    assert name in message and other in message


def test_a_tied_config_with_a_stored_head_is_refused(tmp_path):
    folder = saved(hf_llama(), tmp_path / "llama")
    path = folder / "config.json"
    path.write_text(
        json.dumps({**json.loads(path.read_text()), "tie_word_embeddings": True})
    )
    with pytest.raises(CheckpointError, match="ties the head"):
        read_checkpoint(folder)


def test_a_folder_of_another_config_is_refused_naming_the_field(folder):
    config = read_config_of(hf_llama())
    config.rope_theta = 10_000.0
    model = Llama(config)
    with pytest.raises(CheckpointError, match="rope_theta: 500000.0 in config.json"):
        load_weights(model, folder)


def test_a_pickled_checkpoint_is_not_read(folder):
    for path in folder.glob("model*"):
        path.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="pickle"):
        read_checkpoint(folder)
