"""Checkpoint files: weights, full training state, atomic writes, safetensors, errors, meta-device loading."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import safetensors
import torch
from torch import nn

from torchbook import checkpoint as ckpt
from torchbook.checkpoint import CheckpointError
from torchbook.models import GPT, GPTConfig, TinyMLP

TINY_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32)


def fresh_mlp(seed: int) -> TinyMLP:
    torch.manual_seed(seed)
    return TinyMLP(8, 16, 4)


def fresh_gpt(seed: int, config: GPTConfig = TINY_GPT) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_same_tensors(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), f"{name} differs"


def make_training_objects(seed: int):
    """A TinyMLP with AdamW, a LambdaLR schedule and an (enabled) GradScaler, after two real steps."""
    model = fresh_mlp(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(2):
        train_one_step(model, optimizer, scheduler, scaler, generator)
    return model, optimizer, scheduler, scaler


def train_one_step(model, optimizer, scheduler, scaler, generator) -> float:
    x = torch.randn(4, 8, generator=generator)
    y = torch.randint(0, 4, (4,), generator=generator)
    loss = nn.functional.cross_entropy(nn.functional.dropout(model(x), 0.5), y)  # dropout: uses the global RNG
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss.item()


@dataclass
class SmallModelConfig:
    hidden: int = 16


@dataclass
class SmallTrainConfig:
    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.95)


# ----------------------------------------------------------------- weights


def test_weights_round_trip_gives_identical_tensors(tmp_path):
    original = fresh_mlp(0)
    path = ckpt.save_weights(original, tmp_path / "weights.pt")
    loaded = ckpt.load_weights(fresh_mlp(1), path)
    assert_same_tensors(snapshot(loaded), snapshot(original))


def test_saved_weights_load_with_plain_torch_load_weights_only(tmp_path):
    original = fresh_mlp(0)
    ckpt.save_weights(original, tmp_path / "weights.pt")
    plain = torch.load(tmp_path / "weights.pt", map_location="cpu", weights_only=True)
    assert_same_tensors(plain, snapshot(original))


def test_compiled_model_weights_load_into_plain_model(tmp_path):
    original = fresh_mlp(0)
    compiled = torch.compile(original)  # compiling happens at the first call; the wrapper exists now
    assert all(key.startswith("_orig_mod.") for key in compiled.state_dict())
    torch.save(compiled.state_dict(), tmp_path / "compiled.pt")
    loaded = ckpt.load_weights(fresh_mlp(1), tmp_path / "compiled.pt")
    assert_same_tensors(snapshot(loaded), snapshot(original))


def test_weights_load_into_a_compiled_model(tmp_path):
    original = fresh_mlp(0)
    ckpt.save_weights(original, tmp_path / "weights.pt")
    target = fresh_mlp(1)
    ckpt.load_weights(torch.compile(target), tmp_path / "weights.pt")
    assert_same_tensors(snapshot(target), snapshot(original))


def test_unwrap_keeps_a_submodule_called_module():
    state = {"module.weight": torch.zeros(1), "head.weight": torch.zeros(1)}
    assert list(ckpt.unwrap_state_dict(state)) == ["module.weight", "head.weight"]


def test_architecture_mismatch_lists_keys_and_leaves_model_unchanged(tmp_path):
    ckpt.save_weights(fresh_gpt(0), tmp_path / "gpt.pt")
    deeper = fresh_gpt(1, GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, d_model=32))
    before = snapshot(deeper)
    with pytest.raises(CheckpointError) as caught:
        ckpt.load_weights(deeper, tmp_path / "gpt.pt")
    message = str(caught.value)
    assert str(tmp_path / "gpt.pt") in message
    assert "missing keys" in message and "blocks.2.attn.qkv.weight" in message
    assert_same_tensors(snapshot(deeper), before)


def test_shape_mismatch_is_refused_before_anything_is_copied(tmp_path):
    ckpt.save_weights(fresh_gpt(0), tmp_path / "gpt.pt")
    wider_vocab = fresh_gpt(1, GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, d_model=32))
    before = snapshot(wider_vocab)
    with pytest.raises(CheckpointError, match=r"token_embedding.weight: shape \(64, 32\) in the file, \(65, 32\)"):
        ckpt.load_weights(wider_vocab, tmp_path / "gpt.pt")
    # plain load_state_dict would have copied every tensor that fits before raising
    assert_same_tensors(snapshot(wider_vocab), before)


def test_dtype_mismatch_is_refused(tmp_path):
    torch.save({k: v.half() for k, v in fresh_mlp(0).state_dict().items()}, tmp_path / "half.pt")
    with pytest.raises(CheckpointError, match="fc1.weight: dtype torch.float16 in the file, torch.float32"):
        ckpt.load_weights(fresh_mlp(1), tmp_path / "half.pt")


def test_truncated_checkpoint_is_refused_with_its_path(tmp_path):
    ckpt.save_weights(fresh_mlp(0), tmp_path / "weights.pt")
    data = (tmp_path / "weights.pt").read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    model = fresh_mlp(1)
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=rf"{truncated}: truncated or corrupt"):
        ckpt.load_weights(model, truncated)
    assert_same_tensors(snapshot(model), before)


def test_empty_file_is_refused_with_its_path(tmp_path):
    path = tmp_path / "empty.pt"
    path.touch()
    with pytest.raises(CheckpointError, match=rf"{path}: the file is empty"):
        ckpt.load_weights(fresh_mlp(0), path)


def test_text_file_is_refused_as_another_kind(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("step 100: loss 2.31\n")
    with pytest.raises(CheckpointError, match=rf"{path}: not a file written by torch.save"):
        ckpt.load_weights(fresh_mlp(0), path)


def test_safetensors_file_is_refused_by_the_torch_loader(tmp_path):
    path = ckpt.save_safetensors(fresh_mlp(0), tmp_path / "weights.safetensors")
    with pytest.raises(CheckpointError, match=rf"{path}: is a safetensors file"):
        ckpt.load_weights(fresh_mlp(1), path)


def test_training_checkpoint_is_not_taken_for_a_weights_file(tmp_path):
    model, optimizer, _, _ = make_training_objects(0)
    path = ckpt.save_training_checkpoint(tmp_path, step=2, model=model, optimizer=optimizer)
    with pytest.raises(CheckpointError, match="is a training checkpoint, not a weights file"):
        ckpt.load_weights(fresh_mlp(1), path)
    weights_only = ckpt.load_weights_from_training_checkpoint(fresh_mlp(1), path)
    assert_same_tensors(snapshot(weights_only), snapshot(model))


def test_weights_file_is_not_taken_for_a_training_checkpoint(tmp_path):
    path = ckpt.save_weights(fresh_mlp(0), tmp_path / "weights.pt")
    model, optimizer, _, _ = make_training_objects(1)
    with pytest.raises(CheckpointError, match="not a training checkpoint"):
        ckpt.load_training_checkpoint(path, model=model, optimizer=optimizer)


class WritesMarkerWhenUnpickled:
    """Unpickling this calls Path.touch(marker): harmless, but it is code running from a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_crafted_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "code_ran"
    torch.save({"weight": torch.zeros(2), "payload": WritesMarkerWhenUnpickled(marker)}, tmp_path / "evil.pt")
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="refused by torch.load\\(weights_only=True\\)"):
        ckpt.read_torch_file(tmp_path / "evil.pt")
    assert not marker.exists(), "loading the crafted file ran its code"
    # the independent check that the payload is live: an unsafe load does run it
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


# ----------------------------------------------------------------- atomic writes


def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "weights.pt"
    path.write_bytes(b"old and whole")

    def write_half_then_fail(temporary: Path) -> None:
        temporary.write_bytes(b"new but")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.atomic_write(path, write_half_then_fail)
    assert path.read_bytes() == b"old and whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.pt"]


def test_temporary_file_is_never_listed_as_a_checkpoint(tmp_path):
    (tmp_path / ".step_00000009.pt.tmp-123").write_bytes(b"partial")
    (tmp_path / "step_00000003.pt").write_bytes(b"")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000003.pt"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000003.pt"


def test_keep_last_deletes_only_older_checkpoints(tmp_path):
    model, optimizer, _, _ = make_training_objects(0)
    for step in (1, 2, 3, 4):
        ckpt.save_training_checkpoint(tmp_path, step=step, model=model, optimizer=optimizer, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000003.pt", "step_00000004.pt"]


# ----------------------------------------------------------------- full training state


def test_training_checkpoint_loads_with_plain_torch_load_weights_only(tmp_path):
    model, optimizer, scheduler, scaler = make_training_objects(0)
    path = ckpt.save_training_checkpoint(
        tmp_path, step=2, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
        data_state={"batches_consumed": 2}, model_config=SmallModelConfig(), train_config=SmallTrainConfig(),
        history=[{"step": 1, "loss": 1.5}])
    state = torch.load(path, weights_only=True)
    assert state["model_config"] == {"hidden": 16}
    assert state["train_config"] == {"lr": 1e-2, "betas": (0.9, 0.95)}
    assert state["data"] == {"batches_consumed": 2}
    assert isinstance(state["rng"]["numpy"]["keys"], torch.Tensor)


def test_save_refuses_values_weights_only_cannot_load(tmp_path):
    model, optimizer, _, _ = make_training_objects(0)
    with pytest.raises(CheckpointError, match=r"state\['data'\]\['order'\]: numpy.ndarray"):
        ckpt.save_training_checkpoint(tmp_path, step=1, model=model, optimizer=optimizer,
                                      data_state={"order": np.arange(3)})
    assert list(tmp_path.iterdir()) == []


def test_rng_state_round_trip_repeats_every_generator():
    state = ckpt.capture_rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3))
    ckpt.restore_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[0] == again[0] and first[1] == again[1] and torch.equal(first[2], again[2])


def test_resume_continues_exactly_like_the_original_objects(tmp_path):
    """Optimizer moments, schedule, scaler and RNG restored: the next steps match bit for bit."""
    model, optimizer, scheduler, scaler = make_training_objects(0)
    path = ckpt.save_training_checkpoint(tmp_path, step=2, model=model, optimizer=optimizer,
                                         scheduler=scheduler, scaler=scaler)
    continued = [train_one_step(model, optimizer, scheduler, scaler, torch.Generator().manual_seed(7))
                 for _ in range(3)]

    torch.manual_seed(12345)  # scramble the global RNG the checkpoint must restore
    other = fresh_mlp(99)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other_scheduler = torch.optim.lr_scheduler.LambdaLR(other_optimizer, lambda step: 1.0 / (1 + step))
    other_scaler = torch.amp.GradScaler("cpu")
    resumed = ckpt.load_training_checkpoint(path, model=other, optimizer=other_optimizer,
                                            scheduler=other_scheduler, scaler=other_scaler)
    assert resumed.step == 2
    assert other_scheduler.last_epoch == 2
    replayed = [train_one_step(other, other_optimizer, other_scheduler, other_scaler,
                               torch.Generator().manual_seed(7)) for _ in range(3)]
    assert replayed == continued
    assert_same_tensors(snapshot(other), snapshot(model))


def test_skipped_steps_come_back_with_the_step(tmp_path):
    model, optimizer, _, _ = make_training_objects(0)
    path = ckpt.save_training_checkpoint(tmp_path, step=2, skipped_steps=3, model=model, optimizer=optimizer)
    target, target_optimizer, _, _ = make_training_objects(1)
    resumed = ckpt.load_training_checkpoint(path, model=target, optimizer=target_optimizer)
    assert (resumed.step, resumed.skipped_steps) == (2, 3)


def test_different_model_config_is_refused_and_nothing_is_loaded(tmp_path):
    model, optimizer, _, _ = make_training_objects(0)
    path = ckpt.save_training_checkpoint(tmp_path, step=2, model=model, optimizer=optimizer,
                                         model_config=SmallModelConfig(hidden=16))
    target, target_optimizer, _, _ = make_training_objects(1)
    weights_before = snapshot(target)
    optimizer_before = target_optimizer.state_dict()["state"][0]["exp_avg"].clone()
    with pytest.raises(CheckpointError, match=rf"(?s){path}: was saved for a different model configuration.*"
                                              r"hidden: 16 in the checkpoint, 32 now"):
        ckpt.load_training_checkpoint(path, model=target, optimizer=target_optimizer,
                                      model_config=SmallModelConfig(hidden=32))
    assert_same_tensors(snapshot(target), weights_before)
    assert torch.equal(target_optimizer.state_dict()["state"][0]["exp_avg"], optimizer_before)


def test_different_training_config_is_loaded_and_reported(tmp_path):
    model, optimizer, _, _ = make_training_objects(0)
    path = ckpt.save_training_checkpoint(tmp_path, step=2, model=model, optimizer=optimizer,
                                         train_config=SmallTrainConfig(lr=1e-2))
    target, target_optimizer, _, _ = make_training_objects(1)
    resumed = ckpt.load_training_checkpoint(path, model=target, optimizer=target_optimizer,
                                            train_config=SmallTrainConfig(lr=3e-3))
    assert resumed.train_config_changes == ["lr: 0.01 in the checkpoint, 0.003 now"]
    assert_same_tensors(snapshot(target), snapshot(model))


def test_optimizer_of_another_shape_is_refused_before_the_model_changes(tmp_path):
    model, optimizer, _, _ = make_training_objects(0)
    path = ckpt.save_training_checkpoint(tmp_path, step=2, model=model, optimizer=optimizer)
    target = fresh_mlp(1)
    split = torch.optim.AdamW([{"params": [target.fc1.weight, target.fc1.bias]},
                               {"params": [target.fc2.weight, target.fc2.bias]}])
    before = snapshot(target)
    with pytest.raises(CheckpointError, match="optimizer: 1 parameter groups in the file, 2 now"):
        ckpt.load_training_checkpoint(path, model=target, optimizer=split)
    assert_same_tensors(snapshot(target), before)


def test_missing_scheduler_is_refused(tmp_path):
    model, optimizer, scheduler, _ = make_training_objects(0)
    path = ckpt.save_training_checkpoint(tmp_path, step=2, model=model, optimizer=optimizer, scheduler=scheduler)
    target, target_optimizer, _, _ = make_training_objects(1)
    with pytest.raises(CheckpointError, match="scheduler: the file has one"):
        ckpt.load_training_checkpoint(path, model=target, optimizer=target_optimizer)


# ----------------------------------------------------------------- safetensors and big-model loading


def test_safetensors_round_trip_keeps_tied_weights_stored_once(tmp_path):
    original = fresh_gpt(0)
    path = ckpt.save_safetensors(original, tmp_path / "gpt.safetensors")
    with safetensors.safe_open(path, framework="pt") as handle:
        stored = set(handle.keys())
    assert len(stored) == len(original.state_dict()) - 1  # the tied head is stored once, as an alias
    loaded = ckpt.load_safetensors(fresh_gpt(1), path)
    assert loaded.lm_head.weight is loaded.token_embedding.weight
    assert_same_tensors(snapshot(loaded), snapshot(original))


def test_plain_safetensors_refuses_shared_tensors(tmp_path):
    import safetensors.torch

    with pytest.raises(RuntimeError, match="share memory"):
        safetensors.torch.save_file(fresh_gpt(0).state_dict(), tmp_path / "plain.safetensors")


def test_truncated_safetensors_is_refused_with_its_path(tmp_path):
    path = ckpt.save_safetensors(fresh_mlp(0), tmp_path / "weights.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=rf"{path}: unreadable safetensors file"):
        ckpt.load_safetensors(fresh_mlp(1), path)


def test_sharded_safetensors_index_maps_every_tensor(tmp_path):
    original = fresh_gpt(0)
    max_bytes = 20_000
    index_path = ckpt.save_sharded_safetensors(original, tmp_path / "sharded", max_shard_bytes=max_bytes)
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    stored = set(index["weight_map"]) | set(index["metadata"][ckpt.ALIASES_KEY])
    assert stored == set(original.state_dict())
    expected_total = sum(t.numel() * t.element_size() for n, t in original.state_dict().items()
                         if n not in index["metadata"][ckpt.ALIASES_KEY])
    assert index["metadata"]["total_size"] == expected_total
    for shard in shards:
        with safetensors.safe_open(tmp_path / "sharded" / shard, framework="pt") as handle:
            sizes = [handle.get_tensor(n).numel() * 4 for n in handle.keys()]
        assert sum(sizes) <= max_bytes or len(sizes) == 1
    loaded = ckpt.load_safetensors(fresh_gpt(1), tmp_path / "sharded")
    assert_same_tensors(snapshot(loaded), snapshot(original))


def test_load_on_meta_gives_the_same_model_without_initialising_it(tmp_path):
    original = fresh_gpt(0)
    path = ckpt.save_weights(original, tmp_path / "gpt.pt")
    built = []

    def build() -> GPT:
        built.append(GPT(TINY_GPT))
        assert built[-1].token_embedding.weight.is_meta  # no memory, no initialisation
        return built[-1]

    loaded = ckpt.load_on_meta(build, ckpt.read_torch_file(path, mmap=True), path)
    assert ckpt.meta_tensors(loaded) == []
    assert loaded.lm_head.weight is loaded.token_embedding.weight
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded.eval()(tokens), original.eval()(tokens))


def test_building_everything_on_meta_leaves_unsaved_buffers_without_values(tmp_path):
    path = ckpt.save_weights(fresh_gpt(0), tmp_path / "gpt.pt")
    with torch.device("meta"):
        model = GPT(TINY_GPT)
    model.load_state_dict(ckpt.read_torch_file(path), assign=True)
    assert set(ckpt.meta_tensors(model)) == {"causal_mask", "rope_cos", "rope_sin"}


def test_mmap_load_gives_the_same_tensors(tmp_path):
    original = fresh_gpt(0)
    path = ckpt.save_weights(original, tmp_path / "gpt.pt")
    assert_same_tensors(ckpt.read_torch_file(path, mmap=True), ckpt.read_torch_file(path))


def test_temporary_name_is_in_the_same_folder():
    # os.replace is only atomic within one file system: the temporary must sit next to the target
    path = Path("/some/folder/step_00000001.pt")
    assert ckpt.temporary_path(path).parent == path.parent
    assert not ckpt.CHECKPOINT_PATTERN.match(ckpt.temporary_path(path).name)
    assert str(os.getpid()) in ckpt.temporary_path(path).name


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_rng_states_on_a_machine_without_cuda_are_refused_before_loading(tmp_path):
    model, optimizer, _, _ = make_training_objects(0)
    path = ckpt.save_training_checkpoint(tmp_path, step=2, model=model, optimizer=optimizer)
    state = torch.load(path, weights_only=True)
    state["rng"]["torch_cuda"] = [torch.zeros(16, dtype=torch.uint8)]  # as if saved on one GPU
    torch.save(state, path)
    target, target_optimizer, _, _ = make_training_objects(1)
    before = snapshot(target)
    with pytest.raises(CheckpointError, match="rng: states for 1 CUDA devices in the file, 0 here"):
        ckpt.load_training_checkpoint(path, model=target, optimizer=target_optimizer)
    assert_same_tensors(snapshot(target), before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_restoring_foreign_cuda_rng_states_changes_no_generator():
    state = ckpt.capture_rng_state()
    state["torch_cuda"] = [torch.zeros(16, dtype=torch.uint8)]  # as if captured on one GPU
    random.seed(1)
    expected = random.getstate()
    with pytest.raises(CheckpointError, match="rng: states for 1 CUDA devices in the file, 0 here"):
        ckpt.restore_rng_state(state, "test")
    assert random.getstate() == expected  # Python's generator, restored first otherwise, is untouched


def test_save_refuses_container_subclasses_that_weights_only_refuses(tmp_path):
    from collections import defaultdict

    model, optimizer, _, _ = make_training_objects(0)
    with pytest.raises(CheckpointError, match=r"state\['history'\]: collections.defaultdict"):
        ckpt.save_training_checkpoint(tmp_path, step=1, model=model, optimizer=optimizer,
                                      history=defaultdict(list))


def test_a_long_list_of_missing_keys_is_cut_short_with_its_count(tmp_path):
    ckpt.save_weights(fresh_gpt(0), tmp_path / "gpt.pt")
    much_deeper = fresh_gpt(1, GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=2, d_model=32))
    missing = 6 * 12  # six extra blocks of 12 tensors each
    with pytest.raises(CheckpointError, match=rf"{missing} missing keys .* and {missing - ckpt.LISTED_KEYS} more"):
        ckpt.load_weights(much_deeper, tmp_path / "gpt.pt")
