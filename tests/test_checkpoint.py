"""checkpoint.py and rng_state.py: weights, checkpoints, RNG, rotation and refusals."""

from __future__ import annotations

import copy
import errno
import functools
import pickle
import random
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tensor_checks import assert_same_tensors, snapshot
from torchbook import checkpoint as ckpt
from torchbook.checkpoint import CheckpointError
from torchbook.files import is_temporary
from torchbook.models import GPT, GPTConfig, TinyMLP
from torchbook.optim import learning_rate
from torchbook.rng_state import (
    capture_rng_state,
    restore_rng_state,
    rng_device_problems,
    rng_state_problems,
)
from torchbook.state_dicts import LISTED_KEYS, unwrap_model, unwrap_state_dict
from torchbook.train import TrainConfig, Trainer
from torchbook.weights import save_safetensors

CPU = torch.device("cpu")
# the tests train on the CPU: the checkpoint saves no device generator
save_checkpoint = functools.partial(ckpt.save_training_checkpoint, device=CPU)
TINY_GPT = GPTConfig(
    vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32, dropout=0.1
)


def fresh_mlp(seed: int) -> TinyMLP:
    torch.manual_seed(seed)
    return TinyMLP(8, 16, 4)


def fresh_gpt(seed: int, config: GPTConfig = TINY_GPT) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


@dataclass
class SmallModelConfig:
    hidden: int = 16


def token_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY_GPT.vocab_size, (2, 8), generator=generator)
    return x, torch.randint(0, TINY_GPT.vocab_size, (2, 8), generator=generator)


def fp16_trainer(seed: int, **overrides) -> Trainer:
    """A tiny GPT in fp16, so the scaler has a state too.

    Dropout is on: it draws from the global RNG.
    """
    settings = dict(
        max_steps=20, lr=1e-2, warmup_steps=2, precision="fp16", log_every=3
    )
    settings.update(overrides)
    return Trainer(fresh_gpt(seed), TrainConfig(**settings), torch.device("cpu"))


def trained(seed: int = 0, steps: int = 2, **overrides) -> Trainer:
    trainer = fp16_trainer(seed, **overrides)
    for step in range(steps):
        trainer.train_step([token_batch(step)])
    return trainer


# ------------------------------------------------------------------------------ weights


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
    # compiling happens at the first call; the wrapper exists now
    compiled = torch.compile(original)
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
    assert list(unwrap_state_dict(state)) == ["module.weight", "head.weight"]


def test_unwrap_removes_nested_wrapper_prefixes_and_finds_the_plain_module():
    model = fresh_mlp(0)
    state = {
        f"module._orig_mod.{key}": value for key, value in model.state_dict().items()
    }
    assert list(unwrap_state_dict(state)) == list(model.state_dict())
    assert unwrap_model(torch.compile(model)) is model


def test_architecture_mismatch_lists_keys_and_leaves_model_unchanged(tmp_path):
    ckpt.save_weights(fresh_gpt(0), tmp_path / "gpt.pt")
    deeper = fresh_gpt(
        1, GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, d_model=32)
    )
    before = snapshot(deeper)
    with pytest.raises(CheckpointError) as caught:
        ckpt.load_weights(deeper, tmp_path / "gpt.pt")
    message = str(caught.value)
    assert str(tmp_path / "gpt.pt") in message
    assert "missing keys" in message and "blocks.2.attn.qkv.weight" in message
    assert_same_tensors(snapshot(deeper), before)


def test_shape_mismatch_is_refused_before_anything_is_copied(tmp_path):
    ckpt.save_weights(fresh_gpt(0), tmp_path / "gpt.pt")
    wider_vocab = fresh_gpt(
        1, GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, d_model=32)
    )
    before = snapshot(wider_vocab)
    with pytest.raises(
        CheckpointError,
        match=r"token_embedding.weight: torch.float32 \(64, 32\) in the file, "
        r"torch.float32 \(65, 32\)",
    ):
        ckpt.load_weights(wider_vocab, tmp_path / "gpt.pt")
    # plain load_state_dict would have copied every tensor that fits before raising
    assert_same_tensors(snapshot(wider_vocab), before)


def test_dtype_mismatch_is_refused(tmp_path):
    torch.save(
        {k: v.half() for k, v in fresh_mlp(0).state_dict().items()},
        tmp_path / "half.pt",
    )
    with pytest.raises(
        CheckpointError,
        match=r"fc1.weight: torch.float16 \(16, 8\) in the file, torch.float32",
    ):
        ckpt.load_weights(fresh_mlp(1), tmp_path / "half.pt")


def test_truncated_checkpoint_is_refused_with_its_path(tmp_path):
    ckpt.save_weights(fresh_mlp(0), tmp_path / "weights.pt")
    data = (tmp_path / "weights.pt").read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    model = fresh_mlp(1)
    before = snapshot(model)
    with pytest.raises(
        CheckpointError, match=rf"{truncated}: truncated torch.save archive"
    ):
        ckpt.load_weights(model, truncated)
    assert_same_tensors(snapshot(model), before)


def test_empty_file_is_refused_with_its_path(tmp_path):
    path = tmp_path / "empty.pt"
    path.touch()
    with pytest.raises(
        CheckpointError,
        match=rf"{path}: not a file written by torch.save .*: it is empty",
    ):
        ckpt.load_weights(fresh_mlp(0), path)


def test_text_file_is_refused_as_another_kind(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("step 100: loss 2.31\n")
    with pytest.raises(
        CheckpointError, match=rf"{path}: not a file written by torch.save"
    ):
        ckpt.load_weights(fresh_mlp(0), path)


def test_safetensors_file_is_refused_by_the_torch_loader(tmp_path):
    path = save_safetensors(fresh_mlp(0), tmp_path / "weights.safetensors")
    with pytest.raises(
        CheckpointError,
        match=rf"{path}: not a file written by torch.save .*: it is a safetensors",
    ):
        ckpt.load_weights(fresh_mlp(1), path)


class WritesMarkerWhenUnpickled:
    """Unpickling this calls Path.touch(marker): harmless, but code run from a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_crafted_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "code_ran"
    torch.save(
        {"weight": torch.zeros(2), "payload": WritesMarkerWhenUnpickled(marker)},
        tmp_path / "evil.pt",
    )
    assert not marker.exists()
    with pytest.raises(
        CheckpointError, match="refused by torch.load\\(weights_only=True\\)"
    ):
        ckpt.read_torch_file(tmp_path / "evil.pt")
    assert not marker.exists(), "loading the crafted file ran its code"
    # the independent check that the payload is live: an unsafe load does run it
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


# ------------------------------------ errors on types and bytes, not on torch's wording


def test_a_weights_only_refusal_is_recognised_by_its_type_whatever_its_wording(
    tmp_path, monkeypatch
):
    path = ckpt.save_weights(fresh_mlp(0), tmp_path / "weights.pt")

    def refuse(*args, **kwargs):
        raise pickle.UnpicklingError("some future wording of the refusal")

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(
        CheckpointError,
        match=rf"{path}: refused by torch.load\(weights_only=True\).*future wording",
    ):
        ckpt.read_torch_file(path)


def test_bytes_damaged_inside_a_tensor_are_caught_by_the_archive_crc(tmp_path):
    path = ckpt.save_weights(fresh_gpt(0), tmp_path / "gpt.pt")
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)  # zero 64 bytes inside a tensor's data
    path.write_bytes(bytes(data))
    # the independent check: torch alone loads the damage silently
    torch.load(path, weights_only=True)
    with pytest.raises(
        CheckpointError,
        match=rf"{path}: corrupt torch.save file \(member .*/data/\d+ fails its CRC",
    ):
        ckpt.read_torch_file(path)


def test_mmap_load_gives_the_same_tensors(tmp_path):
    path = ckpt.save_weights(fresh_gpt(0), tmp_path / "gpt.pt")
    assert_same_tensors(
        ckpt.read_torch_file(path, mmap=True), ckpt.read_torch_file(path)
    )


def test_an_mmap_load_skips_the_crc_pass_unless_asked(tmp_path, monkeypatch):
    """Checking every CRC reads the whole file, which an mmap load exists to avoid."""
    path = ckpt.save_weights(fresh_gpt(0), tmp_path / "gpt.pt")
    checked = []
    testzip = zipfile.ZipFile.testzip
    monkeypatch.setattr(
        zipfile.ZipFile, "testzip", lambda self: checked.append(1) or testzip(self)
    )
    ckpt.load_weights(fresh_gpt(1), path, mmap=True)
    assert checked == [], "mmap=True read every byte for the CRCs"
    ckpt.load_weights(fresh_gpt(1), path, mmap=True, verify=True)
    ckpt.load_weights(fresh_gpt(1), path)
    assert checked == [1, 1]


def test_a_memory_error_is_not_called_corruption(tmp_path, monkeypatch):
    path = ckpt.save_weights(fresh_gpt(0), tmp_path / "gpt.pt")

    def out_of_memory(*args, **kwargs):
        raise MemoryError("cannot allocate 4 GB")

    monkeypatch.setattr(torch, "load", out_of_memory)
    with pytest.raises(CheckpointError) as caught:
        ckpt.read_torch_file(path)
    message = str(caught.value)
    assert f"{path}: could not be read" in message and "MemoryError" in message
    assert "corrupt" not in message


# ----------------------------------------------------------------- training checkpoints


def test_load_weights_takes_the_model_weights_of_a_training_checkpoint(tmp_path):
    trainer = trained()
    path = save_checkpoint(tmp_path, trainer.state_dict())
    assert_same_tensors(
        snapshot(ckpt.load_weights(fresh_gpt(1), path)), snapshot(trainer.model)
    )


def test_weights_file_is_not_taken_for_a_training_checkpoint(tmp_path):
    path = ckpt.save_weights(fresh_gpt(0), tmp_path / "weights.pt")
    with pytest.raises(CheckpointError, match="not a training checkpoint"):
        ckpt.load_training_checkpoint(path, fp16_trainer(1))


def test_training_checkpoint_loads_with_plain_torch_load_weights_only(tmp_path):
    trainer = trained(steps=4)  # log_every=3: step 4 is pending
    path = save_checkpoint(
        tmp_path,
        trainer.state_dict(),
        data_state={"batches_consumed": 4},
        model_config=SmallModelConfig(),
    )
    state = torch.load(path, weights_only=True)
    assert state["model_config"] == {"hidden": 16}
    assert state["data"] == {"batches_consumed": 4}
    assert state["trainer"]["step"] + state["trainer"]["skipped_steps"] == 4
    assert state["trainer"]["config"]["precision"] == "fp16"
    # one process: the random states of one rank
    (rng,) = state["rng"]
    assert set(rng) == {"python", "numpy", "torch_cpu", "torch_device"}
    # a CPU run saves no accelerator's generator, though this machine may have one
    assert rng["torch_device"] == {}
    # NumPy's key words as a list: weights_only refuses an ndarray
    assert len(rng["numpy"][1]) == 624


def test_save_refuses_values_weights_only_cannot_load(tmp_path):
    with pytest.raises(
        CheckpointError,
        match=r"not saved; torch.load\(weights_only=True\) could not read it back, "
        r"as it holds .*numpy.ndarray",
    ):
        save_checkpoint(
            tmp_path, trained().state_dict(), data_state={"order": np.arange(3)}
        )
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_container_subclasses_that_weights_only_refuses(tmp_path):
    from collections import defaultdict

    state = trained().state_dict()
    state["history"] = defaultdict(list)
    with pytest.raises(
        CheckpointError,
        match=r"could not read it back, as it holds .*collections.defaultdict",
    ):
        save_checkpoint(tmp_path, state)
    assert list(tmp_path.iterdir()) == []


def test_rng_state_round_trip_repeats_every_generator():
    state = capture_rng_state(CPU)
    first = (random.random(), np.random.rand(), torch.rand(3))
    assert rng_state_problems(state) == rng_device_problems(state, CPU) == []
    restore_rng_state(state, CPU)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert (
        first[0] == again[0]
        and first[1] == again[1]
        and torch.equal(first[2], again[2])
    )


def test_resume_continues_exactly_like_the_original_trainer(tmp_path):
    """Weights, optimizer moments, schedule, scaler, pending losses and RNG all resume.

    The next steps match bit for bit.
    """
    trainer = trained(steps=4)
    path, saved_step = (
        save_checkpoint(tmp_path, trainer.state_dict()),
        trainer.step,
    )
    continued = [
        trainer.train_step([token_batch(10 + i)]).loss.item() for i in range(3)
    ]
    trainer.log()

    torch.manual_seed(12345)  # scramble the global RNG the checkpoint must restore
    other = fp16_trainer(99)
    resumed = ckpt.load_training_checkpoint(path, other)
    assert other.step == saved_step and resumed.config_changes(other.config) == []
    replayed = [other.train_step([token_batch(10 + i)]).loss.item() for i in range(3)]
    other.log()
    assert replayed == continued
    assert [(r["step"], r["loss"], r["lr"]) for r in other.history] == [
        (r["step"], r["loss"], r["lr"]) for r in trainer.history
    ]
    assert_same_tensors(snapshot(other.model), snapshot(trainer.model))


def test_different_model_config_is_refused_and_nothing_is_loaded(tmp_path):
    path = save_checkpoint(
        tmp_path, trained().state_dict(), model_config=SmallModelConfig(16)
    )
    target = trained(seed=1)
    before = snapshot(target.model)
    with pytest.raises(
        CheckpointError,
        match=rf"(?s){path}: cannot be restored; nothing was loaded.*"
        r"hidden: 16 in the checkpoint, 32 now",
    ):
        ckpt.load_training_checkpoint(
            path, target, model_config=SmallModelConfig(hidden=32)
        )
    assert_same_tensors(snapshot(target.model), before)


def test_a_changed_learning_rate_is_applied_and_reported(tmp_path):
    path = save_checkpoint(tmp_path, trained(lr=1e-2).state_dict())
    target = fp16_trainer(1, lr=3e-3)
    resumed = ckpt.load_training_checkpoint(path, target)
    assert "lr: 0.01 in the checkpoint, 0.003 now" in resumed.config_changes(
        target.config
    )
    used = target.train_step([token_batch(5)]).lr
    assert used == learning_rate(target.step - 1, target.config), "the new schedule"


def test_optimizer_of_another_shape_is_refused_before_the_model_changes(tmp_path):
    path = save_checkpoint(tmp_path, trained().state_dict())
    model = fresh_gpt(1)
    one_group = torch.optim.AdamW(model.parameters())
    target = Trainer(
        model, TrainConfig(precision="fp16"), torch.device("cpu"), optimizer=one_group
    )
    before = snapshot(model)
    with pytest.raises(
        CheckpointError, match=r"optimizer: 2 parameter groups in the state, 1 here"
    ):
        ckpt.load_training_checkpoint(path, target)
    assert_same_tensors(snapshot(model), before)


# ----------------------------------------- parse, then apply: a refusal changes nothing


def damaged(path: Path, damage) -> Path:
    state = torch.load(path, weights_only=True)
    damage(state)
    torch.save(state, path)
    return path


def switched_off_scaler(state: dict) -> None:
    state["trainer"]["scaler"] = {}


# One row per refusal class of the trust model (torchbook/checkpoint.py's docstring)
# that a file with valid CRCs can still hit; truncation, bit rot and code-running
# pickles are tested above.
DAMAGES = {
    "format-version": (
        lambda s: s.update(format_version=2),
        r"not a training checkpoint this code reads",
    ),
    "no-trainer": (lambda s: s.pop("trainer"), r"'trainer': NoneType, expected a dict"),
    "trainer-not-a-dict": (
        lambda s: s.update(trainer=[1, 2]),
        r"'trainer': list, expected a dict",
    ),
    "data-not-a-dict": (lambda s: s.update(data=[4]), r"'data': list, expected a dict"),
    "no-rng": (
        lambda s: s.pop("rng"),
        r"rng: None, expected a list of each rank's states",
    ),
    "rng-of-no-rank": (
        lambda s: s.update(rng=[]),
        r"rng: \[\], expected a list of each rank's states",
    ),
    "rng-a-dict": (
        lambda s: s.update(rng=s["rng"][0]),
        r"rng: \{'python': .*, expected a list",
    ),
    "rng-of-two-ranks": (
        lambda s: s["rng"].append(s["rng"][0]),
        r"rng: the random states of 2 ranks in the file, 1 here",
    ),
    "rng-missing-device": (
        lambda s: s["rng"][0].pop("torch_device"),
        r"rng: not restorable \(KeyError",
    ),
    "rng-not-a-dict": (
        lambda s: s["rng"].__setitem__(0, None),
        r"rng: not restorable \(TypeError",
    ),
    "python-rng-short": (
        lambda s: s["rng"][0].update(python=(3, (1, 2, 3), None)),
        r"rng: not restorable",
    ),
    "numpy-rng-short": (
        lambda s: s["rng"][0]["numpy"].__setitem__(1, [0] * 5),
        r"rng: not restorable",
    ),
    "numpy-rng-without-position": (
        lambda s: s["rng"][0].update(numpy=s["rng"][0]["numpy"][:2]),
        r"rng: not restorable \(IndexError",
    ),
    "torch-rng-short": (
        lambda s: s["rng"][0].update(torch_cpu=torch.zeros(10, dtype=torch.uint8)),
        r"rng: not restorable",
    ),
    "no-optimizer": (
        lambda s: s["trainer"].pop("optimizer"),
        r"expected a dict of model, optimizer",
    ),
    "optimizer-none": (
        lambda s: s["trainer"].update(optimizer=None),
        r"optimizer: expected a dict with 'state'",
    ),
    "step-a-string": (
        lambda s: s["trainer"].update(step="3"),
        r"step: '3', expected an int",
    ),
    "history-none": (
        lambda s: s["trainer"].update(history=None),
        r"history, unlogged.*NoneType",
    ),
    "config-a-string": (
        lambda s: s["trainer"].update(config="lr=0.01"),
        r"history, unlogged, seconds_since_log or config: dictionary",
    ),
    "model-key-missing": (
        lambda s: s["trainer"]["model"].pop("lm_head.weight"),
        r"model: 1 missing keys",
    ),
    "optimizer-amsgrad": (
        lambda s: s["trainer"]["optimizer"]["param_groups"][0].update(amsgrad=True),
        r"amsgrad=True in the state, False here",
    ),
    "moment-shape": (
        lambda s: s["trainer"]["optimizer"]["state"][0].update(exp_avg=torch.zeros(3)),
        r"'exp_avg' has shape \(3,\)",
    ),
    "scaler-off": (
        switched_off_scaler,
        r"scaler: keys \[\] in the state, \['_growth_tracker'",
    ),
}


def trainer_and_globals(target: Trainer) -> tuple:
    """Copies of all a load could change: the trainer's state, the global generators."""
    return (
        snapshot(target.model),
        copy.deepcopy(target.optimizer.state_dict()),
        target.step,
        list(target.history),
        target.scaler.get_scale(),
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state()[1].copy(),
    )


def assert_unchanged(target: Trainer, before: tuple) -> None:
    (
        weights,
        optimizer_state,
        step,
        history,
        scale,
        torch_rng,
        python_rng,
        numpy_keys,
    ) = before
    assert_same_tensors(snapshot(target.model), weights)
    after = target.optimizer.state_dict()
    assert after["param_groups"] == optimizer_state["param_groups"]
    for index, entries in optimizer_state["state"].items():
        for key, value in entries.items():
            assert torch.equal(after["state"][index][key], value), (
                f"optimizer {index}.{key} changed"
            )
    assert (target.step, target.history, target.scaler.get_scale()) == (
        step,
        history,
        scale,
    )
    assert (
        torch.equal(torch.get_rng_state(), torch_rng)
        and random.getstate() == python_rng
    ), "a generator changed"
    assert (np.random.get_state()[1] == numpy_keys).all(), "NumPy's generator changed"


@pytest.mark.parametrize("name", list(DAMAGES))
def test_a_damaged_checkpoint_names_the_file_and_changes_nothing(tmp_path, name):
    damage, message = DAMAGES[name]
    path = damaged(save_checkpoint(tmp_path, trained(steps=4).state_dict()), damage)
    target = trained(seed=1, steps=1)
    before = trainer_and_globals(target)
    with pytest.raises(CheckpointError, match=rf"(?s){path}: .*{message}"):
        ckpt.load_training_checkpoint(path, target)
    assert_unchanged(target, before)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def rot_a_tensor(path: Path) -> None:
    data = bytearray(path.read_bytes())
    # inside the largest tensors' bytes
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    path.write_bytes(bytes(data))


def add_a_payload(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    state["trainer"]["history"].append(
        WritesMarkerWhenUnpickled(path.parent / "code_ran")
    )
    torch.save(state, path)


@pytest.mark.parametrize(
    "damage, message",
    [
        (truncate, r"truncated torch.save archive"),
        (rot_a_tensor, r"corrupt torch.save file \(member .* fails its CRC"),
        (add_a_payload, r"refused by torch.load\(weights_only=True\)"),
    ],
    ids=["truncated", "bit-rot", "code-running-pickle"],
)
def test_a_broken_or_crafted_training_checkpoint_changes_nothing(
    tmp_path, damage, message
):
    path = save_checkpoint(tmp_path, trained(steps=4).state_dict())
    damage(path)
    target = trained(seed=1, steps=1)
    before = trainer_and_globals(target)
    with pytest.raises(CheckpointError, match=rf"{path}: {message}"):
        ckpt.load_training_checkpoint(path, target)
    assert_unchanged(target, before)
    assert not (tmp_path / "code_ran").exists(), "loading ran the file's code"


def test_a_cpu_run_saves_no_cuda_state_and_resumes_whatever_the_gpus(
    tmp_path, monkeypatch
):
    """A CPU run on a CUDA machine must not tie its checkpoint to the GPUs there."""
    state = trained().state_dict()
    target = trained(seed=1)
    # This machine, as the checkpoint code sees it: two GPUs, then one.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        torch.cuda,
        "get_rng_state_all",
        lambda: [torch.zeros(16, dtype=torch.uint8)] * 2,
    )
    path = save_checkpoint(tmp_path, state)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ckpt.load_training_checkpoint(path, target)
    assert target.step == 2


def test_a_device_generator_of_another_kind_is_refused_before_loading(tmp_path):
    path = damaged(
        save_checkpoint(tmp_path, trained().state_dict()),
        lambda s: s["rng"][0].update(
            torch_device={"cuda": torch.zeros(16, dtype=torch.uint8)}
        ),
    )
    target = trained(seed=1)
    before = snapshot(target.model)
    with pytest.raises(
        CheckpointError,
        match=r"rng: a cuda generator state in the file, training on cpu here",
    ):
        ckpt.load_training_checkpoint(path, target)
    assert_same_tensors(snapshot(target.model), before)


def test_a_state_with_an_extra_field_is_refused_with_a_checkpoint_error(tmp_path):
    path = damaged(
        save_checkpoint(tmp_path, trained().state_dict()),
        lambda s: s["trainer"].update(extra=1),
    )
    target = trained(seed=1)
    before = trainer_and_globals(target)
    with pytest.raises(CheckpointError, match=rf"(?s){path}: .*'extra'"):
        ckpt.load_training_checkpoint(path, target)
    assert_unchanged(target, before)


def test_a_bad_rng_state_is_found_by_checking_before_any_generator_changes():
    state = capture_rng_state(CPU)
    # torch's generator would refuse it last
    state["torch_cpu"] = torch.zeros(3, dtype=torch.uint8)
    random.seed(1)
    expected = random.getstate()
    problems = rng_state_problems(state)
    assert len(problems) == 1 and problems[0].startswith("rng: not restorable"), (
        problems
    )
    # Python's generator, restored first otherwise, is untouched
    assert random.getstate() == expected


# ----------------------------------------------------------------------------- rotation


def test_keep_last_deletes_only_older_checkpoints(tmp_path):
    trainer = trained()
    for _ in range(4):
        save_checkpoint(tmp_path, trainer.state_dict(), keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        ckpt.checkpoint_name(3, trainer.step),
        ckpt.checkpoint_name(4, trainer.step),
    ]


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    """An earlier run's leftover at a higher step must not outrank the one saved now."""
    later = trained(steps=4)
    leftover = save_checkpoint(tmp_path, later.state_dict())
    earlier = trained(steps=2)
    path = save_checkpoint(tmp_path, earlier.state_dict(), keep_last=1)
    assert later.step > earlier.step
    assert path.exists() and not leftover.exists()
    assert ckpt.latest_checkpoint(tmp_path) == path
    assert ckpt.read_training_checkpoint(path).trainer["step"] == earlier.step


def test_saving_the_same_step_twice_keeps_both_files_in_order(tmp_path):
    trainer = trained()
    first = save_checkpoint(tmp_path, trainer.state_dict(), keep_last=2)
    second = save_checkpoint(tmp_path, trainer.state_dict(), keep_last=2)
    assert first != second and ckpt.list_checkpoints(tmp_path) == [first, second]


def test_a_folder_named_like_a_checkpoint_is_neither_listed_nor_deleted(tmp_path):
    impostor = tmp_path / ckpt.checkpoint_name(50, 1)
    impostor.mkdir()
    path = save_checkpoint(tmp_path, trained().state_dict(), keep_last=1)
    assert ckpt.list_checkpoints(tmp_path) == [path] and impostor.is_dir()
    assert path.name == ckpt.checkpoint_name(51, 2), (
        "the sequence still passes every name in the folder"
    )


@pytest.mark.parametrize("keep_last", [0, True, 2.0])
def test_keep_last_must_be_a_positive_int(tmp_path, keep_last):
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: keep_last={keep_last!r}"):
        save_checkpoint(tmp_path, trained().state_dict(), keep_last=keep_last)


def test_temporary_file_is_never_listed_as_a_checkpoint(tmp_path):
    (tmp_path / f".{ckpt.checkpoint_name(9, 9)}.tmp-abc123").write_bytes(b"partial")
    (tmp_path / ckpt.checkpoint_name(3, 3)).write_bytes(b"")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        ckpt.checkpoint_name(3, 3)
    ]


def test_a_successful_save_removes_leftover_temporaries(tmp_path):
    leftover = tmp_path / f".{ckpt.checkpoint_name(1, 2)}.tmp-abc123"
    leftover.write_bytes(b"half a checkpoint")
    save_checkpoint(tmp_path, trained().state_dict())
    assert not leftover.exists()


# ----------------------------------------------------------- a full disk names the file


def full_disk(kind: str):
    def save(obj, destination, *args, **kwargs):
        Path(destination).write_bytes(b"PK\x03\x04 the first bytes")
        if kind == "torch":  # what torch.save raises when its writer hits ENOSPC
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . "
                "unexpected pos 4416 vs 4310"
            )
        raise OSError(errno.ENOSPC, "No space left on device")

    return save


@pytest.mark.parametrize("kind", ["torch", "oserror"])
def test_a_full_disk_during_a_checkpoint_names_the_file_and_keeps_the_previous_one(
    tmp_path, monkeypatch, kind
):
    trainer = trained()
    previous = save_checkpoint(tmp_path, trainer.state_dict())
    monkeypatch.setattr(torch, "save", full_disk(kind))
    with pytest.raises(
        CheckpointError,
        match=rf"{tmp_path}/{ckpt.checkpoint_name(2, trainer.step)}: "
        r"could not be written .*disk full",
    ):
        save_checkpoint(tmp_path, trainer.state_dict(), keep_last=1)
    monkeypatch.undo()
    assert sorted(tmp_path.iterdir()) == [previous], (
        "the previous checkpoint stays; no temporary is left"
    )
    assert not any(is_temporary(path) for path in tmp_path.iterdir())
    assert ckpt.read_training_checkpoint(previous).trainer["step"] == trainer.step


def test_a_full_disk_during_save_weights_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", full_disk("torch"))
    with pytest.raises(
        CheckpointError, match=rf"{tmp_path / 'w.pt'}: could not be written"
    ):
        ckpt.save_weights(fresh_mlp(0), tmp_path / "w.pt")


def test_a_long_list_of_missing_keys_is_cut_short_with_its_count(tmp_path):
    ckpt.save_weights(fresh_gpt(0), tmp_path / "gpt.pt")
    much_deeper = fresh_gpt(
        1, GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=2, d_model=32)
    )
    missing = 6 * 12  # six extra blocks of 12 tensors each
    with pytest.raises(
        CheckpointError,
        match=rf"{missing} missing keys: .* and {missing - LISTED_KEYS} more",
    ):
        ckpt.load_weights(much_deeper, tmp_path / "gpt.pt")


def test_an_optimizer_flag_saved_as_none_loads_where_the_live_one_is_a_bool(tmp_path):
    # torch's fused/foreach flags are None, True or False: a CPU checkpoint (None)
    # resumes where they are set
    source = trained(steps=2)
    state = source.state_dict()
    for group in state["optimizer"]["param_groups"]:
        group["foreach"] = None
    target = trained(seed=1, steps=1)
    for group in target.optimizer.param_groups:
        group["foreach"] = False
    ckpt.load_training_checkpoint(save_checkpoint(tmp_path, state), target)
    assert target.step == 2
