"""Exact resume, proven with real processes: SIGKILL after a checkpoint, and SIGKILL in the middle of a save.

Each test runs ``python -m torchbook.resume_demo`` (a byte-level GPT trained on
Tiny Shakespeare with dropout, AdamW, a warmup-cosine schedule, one thread,
deterministic algorithms) in subprocesses and compares what they leave behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchbook import checkpoint as ckpt

STEPS = 12
SAVE_EVERY = 4
KILL_AFTER = 2  # checkpoint 2 = step 8
SUBPROCESS_TIMEOUT_S = 120


def demo(folder: Path, out: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torchbook.resume_demo", "--folder", str(folder), "--out", str(out),
               "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())


def finish(process: subprocess.Popen) -> tuple[int, str]:
    stdout, stderr = process.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    return process.returncode, stdout + stderr


def assert_ran(process: subprocess.Popen) -> str:
    code, output = finish(process)
    assert code == 0, output
    return output


def assert_killed(process: subprocess.Popen) -> str:
    code, output = finish(process)
    assert code == -signal.SIGKILL, f"expected death by SIGKILL, got return code {code}:\n{output}"
    return output


@pytest.mark.slow
def test_killed_and_resumed_run_ends_bit_identical_to_an_uninterrupted_run(tmp_path):
    # the two first runs are independent: run them side by side
    uninterrupted = demo(tmp_path / "a", tmp_path / "a.pt")
    killed = demo(tmp_path / "b", tmp_path / "b.pt", "--kill-after-checkpoint", str(KILL_AFTER))
    assert_ran(uninterrupted)
    output = assert_killed(killed)
    assert f"killed after checkpoint {KILL_AFTER}" in output
    assert not (tmp_path / "b.pt").exists()
    assert ckpt.latest_checkpoint(tmp_path / "b").name == ckpt.checkpoint_name(KILL_AFTER * SAVE_EVERY)

    output = assert_ran(demo(tmp_path / "b", tmp_path / "b.pt", "--resume"))
    assert f"resumed from {ckpt.checkpoint_name(KILL_AFTER * SAVE_EVERY)}" in output
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    assert a["steps"] == b["steps"] == list(range(1, STEPS + 1))
    assert a["losses"] == b["losses"]  # exact float equality: bit-exact resume, no tolerance
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), f"{name} differs after resume"


@pytest.mark.slow
def test_resuming_without_the_rng_state_is_not_exact(tmp_path):
    """The control for the test above: dropout draws from the RNG, so skipping its state changes the run."""
    uninterrupted = demo(tmp_path / "a", tmp_path / "a.pt")
    killed = demo(tmp_path / "b", tmp_path / "b.pt", "--kill-after-checkpoint", str(KILL_AFTER))
    assert_ran(uninterrupted)
    assert_killed(killed)
    assert_ran(demo(tmp_path / "b", tmp_path / "b.pt", "--resume", "--no-restore-rng"))
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    resumed_at = KILL_AFTER * SAVE_EVERY
    assert a["losses"][:resumed_at] == b["losses"][:resumed_at]
    assert a["losses"][resumed_at:] != b["losses"][resumed_at:]


@pytest.mark.slow
def test_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    folder = tmp_path / "run"
    output = assert_killed(demo(folder, tmp_path / "out.pt", "--kill-during-save", "3"))
    assert "killed while writing" in output
    partial = [path for path in folder.iterdir() if ckpt.TEMPORARY_MARKER in path.name]
    assert len(partial) == 1 and partial[0].stat().st_size > 0  # the half-written save is on disk...
    with pytest.raises(ckpt.CheckpointError, match="truncated or corrupt"):
        ckpt.read_torch_file(partial[0])  # ...and really is broken
    previous = ckpt.latest_checkpoint(folder)  # ...but it is never taken for a checkpoint
    assert previous.name == ckpt.checkpoint_name(2 * SAVE_EVERY)
    state = ckpt.read_training_checkpoint(previous)
    assert state["step"] == 2 * SAVE_EVERY

    output = assert_ran(demo(folder, tmp_path / "out.pt", "--resume"))
    assert f"resumed from {previous.name}" in output
    assert not [path for path in folder.iterdir() if ckpt.TEMPORARY_MARKER in path.name], \
        "the next successful save should remove the leftover temporary"
