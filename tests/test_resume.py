"""Exact resume, proven in real processes: SIGKILL after a checkpoint or mid-save.

The first tests run ``python examples/resume_demo.py`` (a byte-level GPT trained
on Tiny Shakespeare with dropout, AdamW, a warmup-cosine schedule, one thread,
deterministic algorithms) as a program, in subprocesses, and compare what they
leave behind; the script is never imported. The last one resumes in the same
process, in fp16 with skipped steps and a checkpoint between two log rows, cases
the script's runs (fp32, a log row every step) never meet.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from torchbook import checkpoint as ckpt
from torchbook.book.download import shakespeare_path
from torchbook.data import StreamConfig, TokenStream
from torchbook.files import is_temporary
from torchbook.models import GPT, GPTConfig
from torchbook.shards import write_shard
from torchbook.train import TrainConfig, Trainer

DEMO = Path(__file__).resolve().parents[1] / "examples" / "resume_demo.py"

STEPS = 12
SAVE_EVERY = 4
KILL_AFTER = 2  # checkpoint 2 = step 8
SUBPROCESS_TIMEOUT_S = 120


def demo(folder: Path, out: Path, *extra: str) -> subprocess.Popen:
    command = [
        sys.executable,
        str(DEMO),
        "--folder",
        str(folder),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--save-every",
        str(SAVE_EVERY),
        *extra,
    ]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )


def finish(process: subprocess.Popen) -> tuple[int, str]:
    stdout, stderr = process.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    return process.returncode, stdout + stderr


def assert_ran(process: subprocess.Popen) -> str:
    code, output = finish(process)
    assert code == 0, output
    return output


def assert_killed(process: subprocess.Popen) -> str:
    code, output = finish(process)
    assert code == -signal.SIGKILL, (
        f"expected death by SIGKILL, got return code {code}:\n{output}"
    )
    return output


def test_the_demo_runs_as_a_program_and_lists_its_options():
    done = subprocess.run(
        [sys.executable, str(DEMO), "--help"],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for option in ("--folder", "--resume", "--kill-after-checkpoint", "--lr"):
        assert option in done.stdout, f"{option} missing from --help:\n{done.stdout}"


@pytest.mark.slow
def test_killed_and_resumed_run_ends_bit_identical_to_an_uninterrupted_run(tmp_path):
    # the two first runs are independent: run them side by side
    uninterrupted = demo(tmp_path / "a", tmp_path / "a.pt")
    killed = demo(
        tmp_path / "b", tmp_path / "b.pt", "--kill-after-checkpoint", str(KILL_AFTER)
    )
    assert_ran(uninterrupted)
    output = assert_killed(killed)
    assert f"killed after checkpoint {KILL_AFTER}" in output
    assert not (tmp_path / "b.pt").exists()
    latest = ckpt.latest_checkpoint(tmp_path / "b")
    assert (
        ckpt.read_training_checkpoint(latest).trainer["step"] == KILL_AFTER * SAVE_EVERY
    )

    output = assert_ran(demo(tmp_path / "b", tmp_path / "b.pt", "--resume"))
    assert f"resumed from {latest.name}" in output
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    assert a["steps"] == b["steps"] == list(range(1, STEPS + 1))
    # exact float equality: bit-exact resume, no tolerance
    assert a["losses"] == b["losses"]
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), (
            f"{name} differs after resume"
        )


@pytest.mark.slow
def test_resuming_without_the_rng_state_is_not_exact(tmp_path):
    """Control for the test above: dropout draws from the RNG, so its state matters."""
    uninterrupted = demo(tmp_path / "a", tmp_path / "a.pt")
    killed = demo(
        tmp_path / "b", tmp_path / "b.pt", "--kill-after-checkpoint", str(KILL_AFTER)
    )
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
    partial = [path for path in folder.iterdir() if is_temporary(path)]
    # the half-written save is on disk...
    assert len(partial) == 1 and partial[0].stat().st_size > 0
    with pytest.raises(ckpt.CheckpointError, match="truncated torch.save archive"):
        ckpt.read_torch_file(partial[0])  # ...and really is broken
    # ...but it is never taken for a checkpoint
    previous = ckpt.latest_checkpoint(folder)
    assert ckpt.read_training_checkpoint(previous).trainer["step"] == 2 * SAVE_EVERY

    output = assert_ran(demo(folder, tmp_path / "out.pt", "--resume"))
    assert f"resumed from {previous.name}" in output
    assert not [path for path in folder.iterdir() if is_temporary(path)], (
        "the next successful save should remove the leftover temporary"
    )


# ------------------------------------- in one process: what a checkpoint must carry

IN_PROCESS_STEPS = 10
# not a multiple of LOG_EVERY: the checkpoint falls between two log rows
IN_PROCESS_SAVE_EVERY = 4
LOG_EVERY = 3
# fp16 gradients times this overflow: the scaler skips the first steps
OVERFLOWING_SCALE = 2.0**20


@pytest.fixture
def one_thread():
    """One intra-op thread, so each float sum is added in one order in both runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def byte_shard(tmp_path) -> Path:
    """Tiny Shakespeare as one shard of byte tokens."""
    tokens = np.frombuffer(shakespeare_path().read_bytes(), dtype=np.uint8)
    return write_shard(tmp_path / "bytes.bin", tokens, 256, "utf-8 bytes")


@dataclass
class Fp16Run:
    """The loop of ``resume_demo.py`` in fp16: GradScaler skips its first steps.

    It logs every LOG_EVERY steps and saves every IN_PROCESS_SAVE_EVERY, with the
    count of batches drawn (skipped steps draw too) as the data state.
    """

    folder: Path
    model_config: GPTConfig
    trainer: Trainer
    stream: TokenStream
    batches_drawn: int = 0
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def start(cls, folder: Path, shard: Path) -> Fp16Run:
        model_config = GPTConfig(
            vocab_size=256, block_size=16, n_layer=1, n_head=2, d_model=32, dropout=0.1
        )
        train_config = TrainConfig(
            max_steps=IN_PROCESS_STEPS,
            lr=1e-3,
            warmup_steps=2,
            precision="fp16",
            log_every=LOG_EVERY,
        )
        torch.manual_seed(0)
        trainer = Trainer(GPT(model_config), train_config, torch.device("cpu"))
        trainer.scaler = torch.amp.GradScaler("cpu", init_scale=OVERFLOWING_SCALE)
        stream_config = StreamConfig(
            block_size=16, batch_size=4, shuffle=True, seed=0, epochs=None
        )
        return cls(folder, model_config, trainer, TokenStream([shard], stream_config))

    def resume(self) -> None:
        path = ckpt.latest_checkpoint(self.folder)
        resumed = ckpt.load_training_checkpoint(
            path, self.trainer, model_config=self.model_config
        )
        self.stream.load_state_dict(resumed.data)
        self.batches_drawn = resumed.data["batches_consumed"]

    def train_until(self, until_step: int) -> None:
        if self.batches is None:
            self.batches = iter(self.stream)
        while self.trainer.step < until_step:
            micro_batches = [next(self.batches)]
            self.batches_drawn += len(micro_batches)
            result = self.trainer.train_step(micro_batches)
            if not result.skipped and result.step % IN_PROCESS_SAVE_EVERY == 0:
                ckpt.save_training_checkpoint(
                    self.folder,
                    self.trainer.state_dict(),
                    device=self.trainer.device,
                    data_state=self.stream.state_dict(self.batches_drawn),
                    model_config=self.model_config,
                )


def test_resume_between_log_rows_after_skipped_steps_matches_an_uninterrupted_run(
    tmp_path, one_thread, byte_shard
):
    """Pending losses, skipped steps and the batches they drew survive a checkpoint."""
    whole = Fp16Run.start(tmp_path / "whole", byte_shard)
    whole.train_until(IN_PROCESS_STEPS)
    whole.trainer.log()

    cut = Fp16Run.start(tmp_path / "cut", byte_shard)
    cut.train_until(IN_PROCESS_SAVE_EVERY)
    assert cut.trainer.skipped_steps > 0, (
        "the demonstration needs fp16 steps that the scaler skipped"
    )
    # a fresh process would build the same objects
    resumed = Fp16Run.start(tmp_path / "cut", byte_shard)
    resumed.resume()
    resumed.train_until(IN_PROCESS_STEPS)
    resumed.trainer.log()

    assert resumed.trainer.skipped_steps == whole.trainer.skipped_steps
    assert resumed.batches_drawn == whole.batches_drawn
    assert [row["step"] for row in resumed.trainer.history] == [
        row["step"] for row in whole.trainer.history
    ]
    # exact float equality: same process, one thread, same operations in the same order
    assert [row["loss"] for row in resumed.trainer.history] == [
        row["loss"] for row in whole.trainer.history
    ]
    for name, tensor in whole.trainer.model.state_dict().items():
        assert torch.equal(resumed.trainer.model.state_dict()[name], tensor), (
            f"{name} differs after resume"
        )
