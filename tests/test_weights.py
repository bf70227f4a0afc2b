"""code/torchbook/weights.py: safetensors, tied weights, sharded index, meta device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

from tests.tensor_checks import assert_same_tensors, snapshot
from torchbook import weights
from torchbook.checkpoint import CheckpointError
from torchbook.decoder import rope_tables
from torchbook.models import GPT, GPTConfig, TinyMLP

TINY_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32)
# dropped name, kept name (first in sorted order)
TIED = (
    "token_embedding.weight",
    "lm_head.weight",
)


def fresh_gpt(seed: int, config: GPTConfig = TINY_GPT) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def gpt_buffers(model: GPT) -> None:
    """The GPT's non-persistent buffers, computed as its constructor does."""
    config = model.config
    model.causal_mask = torch.ones(
        config.block_size, config.block_size, dtype=torch.bool
    ).tril()
    model.rope_cos, model.rope_sin = rope_tables(config.head_size, config.block_size)


# --------------------------------------------------------------- one file, tied weights


def test_tied_weights_are_stored_once_and_recorded_as_save_model_does(tmp_path):
    original = fresh_gpt(0)
    path = weights.save_safetensors(
        original, tmp_path / "gpt.safetensors", metadata={"source": "test"}
    )
    with safetensors.safe_open(path, framework="pt") as handle:
        stored, metadata = set(handle.keys()), handle.metadata()
    assert stored == set(original.state_dict()) - {TIED[0]}
    assert metadata == {"source": "test", TIED[0]: TIED[1]}
    loaded = weights.load_safetensors(fresh_gpt(1), path)
    assert loaded.lm_head.weight is loaded.token_embedding.weight
    assert_same_tensors(snapshot(loaded), snapshot(original))


def test_a_file_written_here_loads_with_safetensors_load_model(tmp_path):
    original = fresh_gpt(0)
    path = weights.save_safetensors(original, tmp_path / "gpt.safetensors")
    target = fresh_gpt(1)
    safetensors.torch.load_model(target, path)
    assert_same_tensors(snapshot(target), snapshot(original))


def test_a_file_written_by_save_model_loads_here(tmp_path):
    original = fresh_gpt(0)
    safetensors.torch.save_model(original, tmp_path / "gpt.safetensors")
    loaded = weights.load_safetensors(fresh_gpt(1), tmp_path / "gpt.safetensors")
    assert_same_tensors(snapshot(loaded), snapshot(original))


def test_read_safetensors_restores_the_tied_name_as_the_same_tensor(tmp_path):
    path = weights.save_safetensors(fresh_gpt(0), tmp_path / "gpt.safetensors")
    state = weights.read_safetensors(path)
    assert state[TIED[0]] is state[TIED[1]]
    only = weights.read_safetensors(path, names=[TIED[0]])
    assert list(only) == [TIED[0]] and torch.equal(only[TIED[0]], state[TIED[1]])


def test_different_views_of_one_storage_are_refused():
    base = torch.zeros(4, 4)
    with pytest.raises(
        CheckpointError, match="shares memory with .* but is a different view"
    ):
        weights.drop_shared({"a": base, "b": base[1:]})


def test_overlapping_views_are_refused_naming_the_file_not_written(tmp_path):
    base = torch.zeros(4, 4)
    with pytest.raises(
        CheckpointError,
        match=rf"{tmp_path / 'w.safetensors'}: not written; b: shares memory with a",
    ):
        weights.save_safetensors({"a": base, "b": base[1:]}, tmp_path / "w.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_truncated_safetensors_is_refused_with_its_path(tmp_path):
    path = weights.save_safetensors(TinyMLP(8, 16, 4), tmp_path / "weights.safetensors")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(
        CheckpointError, match=rf"{path}: not a readable safetensors file"
    ):
        weights.load_safetensors(TinyMLP(8, 16, 4), path)


def test_architecture_mismatch_names_the_file_and_leaves_the_model_unchanged(tmp_path):
    path = weights.save_safetensors(fresh_gpt(0), tmp_path / "gpt.safetensors")
    deeper = fresh_gpt(
        1, GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, d_model=32)
    )
    before = snapshot(deeper)
    with pytest.raises(
        CheckpointError,
        match=rf"(?s){path}: does not fit GPT .*12 missing keys: blocks.2",
    ):
        weights.load_safetensors(deeper, path)
    assert_same_tensors(snapshot(deeper), before)


def legacy_file(path: Path, aliases: str) -> Path:
    """A file as this module's earlier versions wrote it: aliases as JSON in one key."""
    state = {
        k: v.contiguous() for k, v in fresh_gpt(0).state_dict().items() if k != TIED[0]
    }
    safetensors.torch.save_file(
        state, path, metadata={weights.LEGACY_ALIASES_KEY: aliases}
    )
    return path


def test_legacy_alias_metadata_is_still_read(tmp_path):
    path = legacy_file(tmp_path / "old.safetensors", json.dumps({TIED[0]: TIED[1]}))
    loaded = weights.read_safetensors(path)
    assert loaded[TIED[0]] is loaded[TIED[1]]


@pytest.mark.parametrize(
    "aliases, message",
    [
        ("{not json", r"metadata field 'torchbook.aliases' is not JSON"),
        (
            '["a", "b"]',
            r"metadata field 'torchbook.aliases' is not a JSON object of names",
        ),
        (
            json.dumps({TIED[0]: "no.such.tensor"}),
            r"metadata field 'torchbook.aliases' names tensors the file does not "
            r"hold: \['no.such.tensor'\]",
        ),
    ],
    ids=["not-json", "not-an-object", "alias-to-missing-tensor"],
)
def test_bad_alias_metadata_names_the_file_and_the_field(tmp_path, aliases, message):
    path = legacy_file(tmp_path / "old.safetensors", aliases)
    with pytest.raises(CheckpointError, match=rf"{path}: {message}"):
        weights.read_safetensors(path)


# ------------------------------------------------------------------------------ sharded


def test_sharded_index_maps_every_stored_tensor_within_the_size_limit(tmp_path):
    original = fresh_gpt(0)
    max_bytes = 20_000
    index_path = weights.save_sharded_safetensors(
        original, tmp_path / "sharded", max_shard_bytes=max_bytes
    )
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert set(index["weight_map"]) == set(original.state_dict()) - {TIED[0]}
    expected_total = sum(
        t.numel() * t.element_size()
        for n, t in original.state_dict().items()
        if n != TIED[0]
    )
    assert index["metadata"]["total_size"] == expected_total
    for shard in shards:
        with safetensors.safe_open(
            tmp_path / "sharded" / shard, framework="pt"
        ) as handle:
            sizes = [handle.get_tensor(n).numel() * 4 for n in handle.keys()]
        assert sum(sizes) <= max_bytes or len(sizes) == 1
    loaded = weights.load_safetensors(fresh_gpt(1), tmp_path / "sharded")
    assert_same_tensors(snapshot(loaded), snapshot(original))


def test_saving_again_with_fewer_shards_leaves_none_of_the_old_ones(tmp_path):
    folder = tmp_path / "sharded"
    weights.save_sharded_safetensors(fresh_gpt(0), folder, max_shard_bytes=20_000)
    index_path = weights.save_sharded_safetensors(
        fresh_gpt(1), folder, max_shard_bytes=10**9
    )
    named = set(json.loads(index_path.read_text())["weight_map"].values())
    assert {path.name for path in folder.glob("*.safetensors")} == named


def test_an_interrupted_save_over_a_previous_one_leaves_no_index(tmp_path, monkeypatch):
    # The previous index would name shards of which some are already the new ones.
    folder = tmp_path / "sharded"
    weights.save_sharded_safetensors(fresh_gpt(0), folder, max_shard_bytes=20_000)
    write = weights._write_safetensors
    written = []

    def write_one_then_fail(path, *args):
        if written:
            raise OSError("disk full")
        written.append(path)
        return write(path, *args)

    monkeypatch.setattr(weights, "_write_safetensors", write_one_then_fail)
    with pytest.raises(OSError, match="disk full"):
        weights.save_sharded_safetensors(fresh_gpt(1), folder, max_shard_bytes=20_000)
    assert not (folder / weights.SAFETENSORS_INDEX).exists()


def test_selective_loading_opens_only_the_shards_it_needs(tmp_path):
    original = fresh_gpt(0)
    index_path = weights.save_sharded_safetensors(
        original, tmp_path / "sharded", max_shard_bytes=20_000
    )
    weight_map = json.loads(index_path.read_text())["weight_map"]
    wanted = ["blocks.1.mlp.proj.weight"]
    needed = weight_map[wanted[0]]
    for shard in set(weight_map.values()) - {needed}:
        # the proof: a shard that is gone cannot have been read
        (tmp_path / "sharded" / shard).unlink()
    got = weights.read_sharded_safetensors(tmp_path / "sharded", names=wanted)
    assert list(got) == wanted and torch.equal(
        got[wanted[0]], original.state_dict()[wanted[0]]
    )


def test_selective_loading_finds_a_tied_name_in_its_shards_metadata(tmp_path):
    original = fresh_gpt(0)
    weights.save_sharded_safetensors(
        original, tmp_path / "sharded", max_shard_bytes=20_000
    )
    got = weights.read_sharded_safetensors(tmp_path / "sharded", names=[TIED[0]])
    assert torch.equal(got[TIED[0]], original.lm_head.weight)


@pytest.mark.parametrize(
    "index, message",
    [
        (
            '{"metadata": "big", "weight_map": {}}',
            r"field 'metadata' is a str, expected an object",
        ),
        (
            '{"metadata": {}, "weight_map": ["a.safetensors"]}',
            r"field 'weight_map' is a list, expected an object",
        ),
        (
            '{"weight_map": {"w": 3}}',
            r"field 'weight_map'\['w'\] is 3, expected the name of a .safetensors file",
        ),
        (
            '{"weight_map": {"w": "../x.safetensors"}}',
            r"field 'weight_map'\['w'\] is '../x.safetensors'",
        ),
        ('["weight_map"]', r"the index is a JSON list, expected an object"),
        ('{"weight_map": ', r"not a JSON index \(JSONDecodeError"),
        (b"\xff\xfe{}", r"not a JSON index \(UnicodeDecodeError"),
    ],
    ids=[
        "metadata-a-string",
        "weight-map-a-list",
        "file-not-a-string",
        "file-outside-the-folder",
        "a-list",
        "not-json",
        "not-utf8",
    ],
)
def test_a_malformed_index_names_the_file_and_the_field(tmp_path, index, message):
    path = tmp_path / weights.SAFETENSORS_INDEX
    path.write_bytes(index if isinstance(index, bytes) else index.encode())
    with pytest.raises(CheckpointError, match=rf"{path}: {message}"):
        weights.read_sharded_safetensors(tmp_path)


def test_a_name_missing_from_the_index_is_named(tmp_path):
    weights.save_sharded_safetensors(fresh_gpt(0), tmp_path, max_shard_bytes=20_000)
    with pytest.raises(
        CheckpointError, match=r"no tensor named \['no.such'\] in field 'weight_map'"
    ):
        weights.read_sharded_safetensors(tmp_path, names=["no.such"])


# ---------------------------------------------------------------------- the meta device


def test_load_on_meta_gives_the_same_model_without_initialising_it(tmp_path):
    original = fresh_gpt(0)
    path = weights.save_safetensors(original, tmp_path / "gpt.safetensors")
    register = nn.Module.register_parameter
    built = []

    def build() -> GPT:
        assert nn.Module.register_parameter is register, (
            "nothing process-wide may be patched"
        )
        built.append(GPT(TINY_GPT))
        assert built[-1].token_embedding.weight.is_meta  # no memory, no initialisation
        return built[-1]

    loaded = weights.load_on_meta(
        build, weights.read_safetensors(path), path, init_buffers=gpt_buffers
    )
    assert weights.meta_tensors(loaded) == []
    assert loaded.lm_head.weight is loaded.token_embedding.weight
    tokens = torch.randint(
        0, TINY_GPT.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(loaded.eval()(tokens), original.eval()(tokens))


def test_load_on_meta_without_buffer_init_names_the_buffers_left_on_meta(tmp_path):
    path = weights.save_safetensors(fresh_gpt(0), tmp_path / "gpt.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"\['causal_mask', 'rope_cos', 'rope_sin'\] are still on the meta",
    ):
        weights.load_on_meta(
            lambda: GPT(TINY_GPT), weights.read_safetensors(path), path
        )


def test_a_full_disk_during_a_safetensors_save_names_the_file(tmp_path, monkeypatch):
    def no_space(tensors, filename, metadata=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", no_space)
    with pytest.raises(
        CheckpointError, match=rf"{tmp_path / 'w.safetensors'}: could not be written"
    ):
        weights.save_safetensors(TinyMLP(8, 16, 4), tmp_path / "w.safetensors")
    assert list(tmp_path.iterdir()) == []
