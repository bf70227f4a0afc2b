"""code/torchbook/hf_checkpoint.py: Hugging Face folders into the book's Llama and back.

The reference is transformers' own ``LlamaForCausalLM``: a folder it saves loads
into the book's module with its logits and its greedy tokens, folders laid out
as real Llama 2, Llama 3 and Llama 3.2 releases load as transformers loads
them, every refusal names the file and the field or key, and what the book
saves is what ``save_pretrained`` saves.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers

from tests.tensor_checks import assert_same_tensors, snapshot
from torchbook import hf_checkpoint, hf_llama_config
from torchbook.hf_checkpoint import (
    CheckpointError,
    load_pretrained,
    load_weights,
    read_checkpoint,
    read_llama_config,
    save_hf_folder,
)
from torchbook.llama import Llama, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
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


def edit_config(folder: Path, change) -> Path:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))
    return path


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
        config = config_of(reference)
        book = Llama(config)
        assert set(hf_checkpoint.hf_state_dict(book)) == hf_keys
        assert {hf_checkpoint.book_key(k) for k in hf_keys} <= set(book.state_dict())


def config_of(model: transformers.LlamaForCausalLM) -> LlamaConfig:
    """The book's config for ``hf_llama``'s model, written out by hand."""
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
    config = config_of(hf_llama(tied=tied))
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


# ------------------------------------------------------------ real releases' layouts

# The public config.json fields of three releases at a small size: the field
# names, the dtype, the RoPE settings and the tying are the releases' own.
LLAMA_2 = {  # meta-llama/Llama-2-7b-hf
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 86,  # 11,008 = 2.6875 x 4,096
    "max_position_embeddings": 64,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.31.0.dev0",
    "use_cache": True,
    "vocab_size": VOCAB,
}
LLAMA_3 = {  # meta-llama/Meta-Llama-3-8B
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 60,  # 128,000 in the release's vocabulary
    "eos_token_id": 61,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 224,  # 14,336 = 3.5 x 4,096
    "max_position_embeddings": 64,
    "model_type": "llama",
    "num_attention_heads": 8,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
    "vocab_size": VOCAB,
}
LLAMA_3_2 = {  # meta-llama/Llama-3.2-1B
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 60,
    "eos_token_id": 61,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 256,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": VOCAB,
}
DTYPE_NAMES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def write_release(
    folder: Path,
    config: dict,
    shards: int = 1,
    extra: dict[str, torch.Tensor] | None = None,
    store_tied_head: bool = False,
    keep_norms_float32: bool = False,
    seed: int = 0,
) -> Path:
    """A release-like folder, written with safetensors: config.json, the weights
    of a random transformers model of that config in the config's dtype, in
    ``shards`` files with an index (listing ``extra`` too) or one model.safetensors.
    """
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(config))
    dtype = DTYPE_NAMES[config["torch_dtype"]]
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config["tie_word_embeddings"]:
            if not store_tied_head:
                continue
            tensor = model.state_dict()["model.embed_tokens.weight"]
        keep = keep_norms_float32 and name.endswith("norm.weight")
        tensors[name] = tensor.detach().clone().to(torch.float32 if keep else dtype)
    tensors.update(extra or {})
    if shards == 1:
        safetensors.torch.save_file(
            tensors, folder / "model.safetensors", metadata={"format": "pt"}
        )
        return folder
    names = list(tensors)
    weight_map = {}
    for number in range(shards):
        part = names[number::shards]
        filename = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        shard = {name: tensors[name] for name in part}
        safetensors.torch.save_file(shard, folder / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


def loads_as_transformers_loads_it(folder: Path) -> None:
    """The same default dtype as transformers, and float32 logits within ATOL/RTOL."""
    reference = transformers.LlamaForCausalLM.from_pretrained(folder)
    assert load_pretrained(folder).lm_head.weight.dtype == reference.dtype
    reference = reference.float().eval()
    model = load_pretrained(folder, dtype=torch.float32).eval()
    idx = prompt(40)
    with torch.no_grad():
        torch.testing.assert_close(
            model(idx), reference(idx).logits, atol=ATOL, rtol=RTOL
        )


def inv_freq(config: dict) -> torch.Tensor:
    head_size = config["hidden_size"] // config["num_attention_heads"]
    return 1.0 / 10_000 ** (torch.arange(0, head_size, 2).float() / head_size)


def test_a_llama_2_folder_whose_index_lists_rotary_inv_freq_loads(tmp_path):
    # Llama 2's files keep each layer's RoPE table, a buffer transformers ignores
    # by name on load (modeling_utils: "rotary_emb.inv_freq").
    extra = {
        f"model.layers.{layer}.self_attn.rotary_emb.inv_freq": inv_freq(LLAMA_2)
        for layer in range(LLAMA_2["num_hidden_layers"])
    }
    folder = write_release(tmp_path / "llama-2", LLAMA_2, shards=2, extra=extra)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert "model.layers.1.self_attn.rotary_emb.inv_freq" in index["weight_map"]
    loads_as_transformers_loads_it(folder)


def test_a_llama_3_folder_loads_as_transformers_loads_it(tmp_path):
    folder = write_release(tmp_path / "llama-3", LLAMA_3, shards=3)
    assert read_llama_config(folder / "config.json").rope_theta == 500_000.0
    loads_as_transformers_loads_it(folder)


def test_a_llama_3_2_folder_loads_as_transformers_loads_it(tmp_path):
    folder = write_release(tmp_path / "llama-3.2", LLAMA_3_2)
    model = load_pretrained(folder)
    assert model.lm_head.weight is model.token_embedding.weight
    assert model.config.rope_scaling.factor == 32.0
    loads_as_transformers_loads_it(folder)


def test_a_tied_head_stored_anyway_loads_when_it_equals_the_embedding(tmp_path):
    folder = write_release(tmp_path / "stored", LLAMA_3_2, store_tied_head=True)
    model = load_pretrained(folder)
    assert model.lm_head.weight is model.token_embedding.weight
    loads_as_transformers_loads_it(folder)


def test_a_stored_tied_head_that_differs_from_the_embedding_is_refused(tmp_path):
    folder = write_release(tmp_path / "stored", LLAMA_3_2, store_tied_head=True)
    rewrite_shard(
        folder / "model.safetensors",
        lambda tensors: tensors["lm_head.weight"].add_(1.0),
    )
    with pytest.raises(CheckpointError) as refused:
        load_pretrained(folder)
    message = str(refused.value)
    assert "model.safetensors" in message and "lm_head.weight" in message
    assert "tie_word_embeddings" in message
    # why: transformers 5 computes with the stored head, no longer the embedding
    reference = transformers.LlamaForCausalLM.from_pretrained(folder)
    stored = safetensors.torch.load_file(folder / "model.safetensors")
    assert torch.equal(reference.lm_head.weight, stored["lm_head.weight"])


def test_bf16_matrices_with_float32_norms_load_as_transformers_loads_them(tmp_path):
    folder = write_release(
        tmp_path / "mixed", LLAMA_3, shards=2, keep_norms_float32=True
    )
    stored = read_checkpoint(folder).tensors
    assert stored["norm_final.weight"].dtype == torch.float32
    assert stored["blocks.0.attn.query.weight"].dtype == torch.bfloat16
    loads_as_transformers_loads_it(folder)


@pytest.mark.slow
@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(),
    reason="the peak is read from Linux's /proc/self/status",
)
def test_loading_in_bf16_from_float32_never_holds_a_float32_copy(tmp_path):
    # About 200 MB in float32, in tensors of at most 12 MB: the model is 100 MB
    # in bf16. Built in float32 and converted afterwards, the load peaked 2.4
    # times that above its start; converted tensor by tensor, the peak is the
    # bf16 model, one float32 tensor and the pages of the shard being read.
    config = {
        **LLAMA_3,
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 2816,
        "num_hidden_layers": 4,
        "vocab_size": 256,
        "torch_dtype": "float32",
    }
    folder = write_release(tmp_path / "f32", config, shards=8)
    tiny = write_release(tmp_path / "tiny", {**LLAMA_3, "torch_dtype": "float32"})
    # A fresh process loads the tiny folder first, so that what the first load
    # of all sets up once (code pages, allocator pools) is not counted; then
    # Linux's peak resident memory (VmHWM, reset by writing 5 to clear_refs)
    # is read around the large load.
    script = (
        "import re, sys, torch\n"
        "from pathlib import Path\n"
        "from torchbook.hf_checkpoint import load_pretrained\n"
        "def kib(field):\n"
        "    status = Path('/proc/self/status').read_text()\n"
        "    return int(re.search(field + r':\\s+(\\d+) kB', status).group(1))\n"
        "load_pretrained(sys.argv[2], dtype=torch.bfloat16)\n"
        "Path('/proc/self/clear_refs').write_text('5')\n"
        "start = kib('VmRSS')\n"
        "model = load_pretrained(sys.argv[1], dtype=torch.bfloat16)\n"
        "size = sum(p.numel() * p.element_size() for p in model.parameters())\n"
        "print((kib('VmHWM') - start) * 1024, size)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(folder), str(tiny)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    peak, size = (int(word) for word in result.stdout.split())
    # measured: 1.36 times the model converting per tensor, 2.36 times before
    assert peak < 1.6 * size, f"peaked {peak / 1e6:.0f} MB for {size / 1e6:.0f} MB"


# ------------------------------------------------------------ config.json, by name


def test_every_field_of_transformers_llama_config_is_read_checked_or_ignored():
    fields = set(inspect.signature(transformers.LlamaConfig.__init__).parameters)
    fields -= {"self", "kwargs"}
    handled = (
        set(hf_llama_config.CONFIG_KEYS)
        | set(hf_llama_config.ROPE_FIELDS)
        | set(hf_llama_config.DTYPE_FIELDS)
        | set(hf_llama_config.CHECKED_FIELDS)
        | set(hf_llama_config.IGNORED_FIELDS)
    )
    assert fields - handled == set()


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("model_type", "mistral", "model_type 'mistral'"),
        ("attention_bias", True, "attention_bias"),
        ("mlp_bias", True, "mlp_bias"),
        ("attention_dropout", 0.1, "attention_dropout 0.1"),
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
    def change(raw):
        if field == "rope_scaling":  # transformers 4's spelling
            raw.pop("rope_parameters")
        raw[field] = value

    path = edit_config(folder, change)
    model = Llama(config_of(hf_llama()))
    before = snapshot(model)

    with pytest.raises(CheckpointError, match=str(path)) as refused:
        load_weights(model, folder)

    assert named in str(refused.value)
    assert_same_tensors(snapshot(model), before)


def test_a_linear_rope_scaling_beside_rope_parameters_is_refused(folder):
    # transformers 5 takes rope_scaling over rope_parameters when both are set,
    # so it would compute a linear scaling the book's module does not.
    def add_scaling(raw):
        raw["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}

    path = edit_config(folder, add_scaling)
    reference = transformers.LlamaConfig.from_pretrained(folder)
    assert reference.rope_parameters["rope_type"] == "linear"
    with pytest.raises(CheckpointError, match="RoPE type 'linear'") as refused:
        read_llama_config(path)
    assert "rope_scaling" in str(refused.value)


def test_an_incomplete_llama3_rope_block_names_the_file_and_the_field(folder):
    def incomplete(raw):
        raw["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": ROPE_THETA,
            "factor": 8.0,
        }

    path = edit_config(folder, incomplete)
    with pytest.raises(CheckpointError, match=str(path)) as refused:
        read_llama_config(path)
    assert "low_freq_factor" in str(refused.value)


def test_llama3_scaling_without_its_original_context_takes_max_positions(folder):
    # as transformers does (standardize_rope_params)
    def no_original(raw):
        raw["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": ROPE_THETA,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        }

    path = edit_config(folder, no_original)
    scaling = read_llama_config(path).rope_scaling
    assert scaling.original_max_positions == 64


def test_the_special_tokens_ids_are_read(folder):
    path = edit_config(
        folder,
        lambda raw: raw.update(bos_token_id=60, eos_token_id=[61, 63], pad_token_id=62),
    )
    config = read_llama_config(path)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        60,
        [61, 63],
        62,
    )


# ------------------------------------------------------------ refusals of weights


def refused_and_unchanged(folder: Path) -> str:
    """The error loading ``folder`` raises; asserts the model was not changed."""
    model = Llama(config_of(hf_llama()))
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


def test_a_folder_of_another_config_is_refused_naming_the_field(folder):
    config = config_of(hf_llama())
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


# ------------------------------------------------------------ saved as save_pretrained


def saved_both_ways(tmp_path: Path, tied: bool = False) -> tuple[Path, Path]:
    """One model saved by transformers' save_pretrained and by the book's saver.

    Special tokens 60/61/62, not transformers' defaults 1/2/None.
    """
    reference = hf_llama(tied=tied, bos_token_id=60, eos_token_id=61, pad_token_id=62)
    theirs = saved(reference, tmp_path / "theirs")
    model = load_pretrained(theirs)
    ours = save_hf_folder(model, tmp_path / "ours", max_shard_bytes=SHARD_BYTES)
    return theirs, ours


def test_the_saved_folder_keeps_the_special_tokens_as_save_pretrained_does(tmp_path):
    theirs, ours = saved_both_ways(tmp_path)
    for folder in (theirs, ours):
        config = transformers.AutoConfig.from_pretrained(folder)
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
            60,
            61,
            62,
        )
    generation = transformers.GenerationConfig.from_pretrained(ours)
    expected = transformers.GenerationConfig.from_pretrained(theirs)
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(generation, field) == getattr(expected, field)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_saved_folder_is_what_save_pretrained_writes(tmp_path, tied):
    theirs, ours = saved_both_ways(tmp_path, tied)
    assert sorted(p.name for p in ours.iterdir()) == sorted(
        p.name for p in theirs.iterdir()
    )

    def read_back(folder: Path) -> dict:
        # Who wrote it (transformers_version, the folder's name) differs by
        # design; initializer_range sets a new model's random start, which a
        # loaded model does not keep (hf_llama's is 0.2, the default 0.02).
        config = transformers.AutoConfig.from_pretrained(folder).to_dict()
        skipped = ("transformers_version", "_name_or_path", "initializer_range")
        return {key: value for key, value in config.items() if key not in skipped}

    assert read_back(ours) == read_back(theirs)
    weights = [
        transformers.LlamaForCausalLM.from_pretrained(folder).state_dict()
        for folder in (theirs, ours)
    ]
    assert_same_tensors(*weights)


def test_transformers_loads_an_older_single_file_left_beside_new_shards(tmp_path):
    # why the saver removes an earlier save's files: save_pretrained (in
    # transformers 5) removes only stale shards, and from_pretrained then
    # prefers the old model.safetensors to the new index
    folder = tmp_path / "saved"
    old, new = hf_llama(seed=1), hf_llama(seed=2)
    old.save_pretrained(folder)
    new.save_pretrained(folder, max_shard_size=SHARD_BYTES)
    assert (folder / "model.safetensors").exists()
    loaded = transformers.LlamaForCausalLM.from_pretrained(folder)
    assert torch.equal(loaded.lm_head.weight, old.lm_head.weight)


def test_saving_removes_an_older_single_file_that_transformers_would_load(tmp_path):
    folder = tmp_path / "saved"
    hf_llama(seed=1).save_pretrained(folder)  # one model.safetensors
    model = Llama(config_of(hf_llama())).eval()
    save_hf_folder(model, folder, max_shard_bytes=SHARD_BYTES)  # shards and index

    assert not (folder / "model.safetensors").exists()
    loaded = transformers.LlamaForCausalLM.from_pretrained(folder)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


# ------------------------------------------------------------ your own checkpoint


@pytest.mark.slow
def test_chapter_8_runs_on_a_llama_3_2_folder_of_your_own(tmp_path):
    """BOOK_PRETRAINED_DIR: chapter 8 loads, checks and saves a reader's folder.

    A Llama 3.2 layout (tied head, llama3 RoPE, bf16, one file without the
    head) with random weights large enough for clear argmaxes, and a tokenizer.
    """
    from torchbook.book.download import shakespeare_path
    from torchbook.hf import hf_tokenizer
    from torchbook.tokenizer import END_OF_TEXT, train_bpe

    tokenizer = train_bpe([shakespeare_path()], vocab_size=512)
    config = {
        **LLAMA_3_2,
        "vocab_size": tokenizer.get_vocab_size(),
        "bos_token_id": None,  # the book's tokenizer has no start token
        "eos_token_id": tokenizer.token_to_id(END_OF_TEXT),
        "initializer_range": 0.2,
    }
    folder = write_release(tmp_path / "Llama-3.2-tiny", config)
    hf_tokenizer(tokenizer).save_pretrained(folder)
    environment = {**os.environ, "BOOK_PRETRAINED_DIR": str(folder)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(ROOT / "chapters" / "08-pretrained.qmd"),
        ],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in result.stdout and "08-pretrained.qmd:" in result.stdout
