"""A small run that checkpoints, can be killed, and resumes exactly: Chapter 5's proof.

Run it three ways from the repository root and compare the final files:

    # uninterrupted
    python examples/resume_demo.py --folder run_a --out a.pt
    # dies (SIGKILL) after checkpoint 2
    python examples/resume_demo.py --folder run_b --out b.pt --kill-after-checkpoint 2
    # continues run_b
    python examples/resume_demo.py --folder run_b --out b.pt --resume

``a.pt`` and ``b.pt`` then hold bit-identical weights and the same loss at
every step. ``--kill-during-save k`` instead dies halfway through writing
checkpoint ``k``, to show that the previous checkpoint survives.

It is a script, not library code: it replaces ``torch.save`` for the whole
process and kills itself. It ties the book's pieces together: a byte-level
``GPT`` (``torchbook.models``) trained on a ``TokenStream`` over Tiny
Shakespeare (``torchbook.data``) by its own short loop around
``Trainer.train_step`` (``torchbook.train``): draw a step's micro-batches,
count them, step, and save every ``save_every`` steps with
``save_training_checkpoint(folder, trainer.state_dict(), device=..., data_state=...)``;
``load_training_checkpoint(path, trainer)`` restores it (``torchbook.checkpoint``).
The trainer's state carries its steps not yet logged, so a checkpoint may fall
between two log rows. The one count the trainer does not keep is the number of
batches drawn from the stream: that is the data state. Exactness needs
deterministic CPU settings: one thread (the order of float additions is fixed),
``torch.use_deterministic_algorithms(True)`` and seeded generators. Dropout is
on, so the RNG state must be restored too.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from torchbook.book.download import shakespeare_path
from torchbook.book.profiles import CheckpointSizes, active_profile
from torchbook.checkpoint import (
    TrainingCheckpoint,
    latest_checkpoint,
    load_training_checkpoint,
    save_training_checkpoint,
)
from torchbook.data import StreamConfig, TokenStream
from torchbook.files import atomic_write
from torchbook.models import GPT, GPTConfig
from torchbook.shards import ShardError, read_header, write_shard
from torchbook.train import TrainConfig, Trainer

BYTE_VOCAB = 256  # tokens are the bytes of the text: no tokenizer needed
LEARNING_RATE = 1e-3
WARMUP_STEPS = 4


def kill_now() -> None:
    """Die as a crash or an out-of-memory kill does: SIGKILL, no cleanup, no flush."""
    os.kill(os.getpid(), signal.SIGKILL)


def die_halfway_through_saves() -> None:
    """Make every later ``torch.save`` write half its bytes, then SIGKILL the process.

    This simulates a crash in the middle of writing a checkpoint (power loss,
    pre-emption). The half that is written is fsync'd, so it really is on disk.
    """
    real_save = torch.save

    def save_half_then_die(obj, destination, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        with open(destination, "wb") as handle:
            handle.write(data[: len(data) // 2])
            handle.flush()
            os.fsync(handle.fileno())
        print(f"killed while writing {destination}", flush=True)
        kill_now()

    torch.save = save_half_then_die


def byte_shard(folder: Path) -> Path:
    """Tiny Shakespeare as one byte-token shard in ``folder``, rewritten unless whole.

    A run killed inside ``write_shard`` leaves the old shard or none (one file,
    renamed into place): the shard is trusted only when ``read_header``
    validates its header against its size.
    """
    path = Path(folder) / "shakespeare_bytes.bin"
    try:
        read_header(path)
    except ShardError:
        tokens = np.frombuffer(shakespeare_path().read_bytes(), dtype=np.uint8)
        write_shard(path, tokens, vocab_size=BYTE_VOCAB, tokenizer="utf-8 bytes")
    return path


def demo_configs(
    sizes: CheckpointSizes, steps: int, seed: int
) -> tuple[GPTConfig, TrainConfig, StreamConfig]:
    """The model, training and data configurations of the demonstration run."""
    model_config = GPTConfig(
        vocab_size=BYTE_VOCAB,
        block_size=sizes.block_size,
        n_layer=sizes.n_layer,
        n_head=sizes.n_head,
        d_model=sizes.d_model,
        dropout=sizes.dropout,
    )
    # one history row per step: the loss of every step is compared
    train_config = TrainConfig(
        max_steps=steps,
        lr=LEARNING_RATE,
        min_lr=LEARNING_RATE / 10,
        warmup_steps=min(WARMUP_STEPS, steps),
        accum_steps=sizes.accum_steps,
        log_every=1,
    )
    stream_config = StreamConfig(
        block_size=sizes.block_size,
        batch_size=sizes.batch_size,
        shuffle=True,
        seed=seed,
        epochs=None,
    )
    return model_config, train_config, stream_config


@dataclass
class Run:
    """A run's live objects, plus the count ``Trainer`` does not keep: batches drawn."""

    folder: Path  # checkpoints go here
    model_config: GPTConfig
    trainer: Trainer
    stream: TokenStream
    save_every: int
    keep_last: int
    # from the start of training; a step the fp16 scaler skips draws batches too
    batches_drawn: int = 0
    # started at the first step
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None

    def save(self) -> Path:
        """Checkpoint the full state (pending losses too) after the latest step."""
        return save_training_checkpoint(
            self.folder,
            self.trainer.state_dict(),
            device=self.trainer.device,
            data_state=self.stream.state_dict(batches_consumed=self.batches_drawn),
            model_config=self.model_config,
            keep_last=self.keep_last,
        )

    def resume(self, path: Path, restore_rng: bool = True) -> TrainingCheckpoint:
        """Restore all that ``save`` wrote into this run, before its first step."""
        if self.batches is not None:
            raise RuntimeError(
                f"{path}: resume before the first step, "
                f"not after {self.batches_drawn} batches"
            )
        resumed = load_training_checkpoint(
            path, self.trainer, model_config=self.model_config, restore_rng=restore_rng
        )
        self.stream.load_state_dict(resumed.data)
        self.batches_drawn = resumed.data["batches_consumed"]
        return resumed

    def train_until(self, until_step: int) -> None:
        """Train until ``trainer.step == until_step``, saving every ``save_every``."""
        if self.batches is None:
            self.batches = iter(self.stream)
        while self.trainer.step < until_step:
            micro_batches = [
                next(self.batches) for _ in range(self.trainer.config.accum_steps)
            ]
            # a step the fp16 scaler skips drew its batches too
            self.batches_drawn += len(micro_batches)
            result = self.trainer.train_step(micro_batches)
            if not result.skipped and result.step % self.save_every == 0:
                path = self.save()
                print(
                    f"checkpoint {result.step // self.save_every} written: {path.name}",
                    flush=True,
                )


def main(argv: list[str] | None = None) -> int:
    sizes = active_profile().checkpoint
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--folder",
        type=Path,
        required=True,
        help="checkpoints (and the data shard) go here",
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="final weights and loss history (torch.save)",
    )
    parser.add_argument("--steps", type=int, default=sizes.steps)
    parser.add_argument("--save-every", type=int, default=sizes.save_every)
    parser.add_argument("--keep-last", type=int, default=sizes.keep_last)
    parser.add_argument("--seed", type=int, default=active_profile().seed)
    parser.add_argument(
        "--lr",
        type=float,
        default=LEARNING_RATE,
        help="peak learning rate (change it on --resume)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --folder",
    )
    parser.add_argument(
        "--no-restore-rng",
        action="store_true",
        help="resume without the RNG state (breaks exactness)",
    )
    parser.add_argument(
        "--kill-after-checkpoint",
        type=int,
        default=None,
        metavar="K",
        help="SIGKILL this process once checkpoint K (step K * save_every) is durable",
    )
    parser.add_argument(
        "--kill-during-save",
        type=int,
        default=None,
        metavar="K",
        help="SIGKILL this process halfway through writing checkpoint K",
    )
    args = parser.parse_args(argv)

    # Deterministic CPU settings: one thread fixes the order of every float sum.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    model_config, train_config, stream_config = demo_configs(
        sizes, args.steps, args.seed
    )
    if args.lr != LEARNING_RATE:
        train_config.lr, train_config.min_lr = args.lr, args.lr / 10
    run = Run(
        folder=args.folder,
        model_config=model_config,
        trainer=Trainer(GPT(model_config), train_config, torch.device("cpu")),
        stream=TokenStream([byte_shard(args.folder)], stream_config),
        save_every=args.save_every,
        keep_last=args.keep_last,
    )

    if args.resume:
        path = latest_checkpoint(args.folder)
        if path is None:
            print(f"{args.folder}: no checkpoint to resume from", file=sys.stderr)
            return 1
        resumed = run.resume(path, restore_rng=not args.no_restore_rng)
        print(f"resumed from {path.name} at step {run.trainer.step}", flush=True)
        for change in resumed.config_changes(run.trainer.config):
            print(f"training configuration changed: {change}", flush=True)

    if args.kill_after_checkpoint is not None:
        run.train_until(args.kill_after_checkpoint * args.save_every)
        print(f"killed after checkpoint {args.kill_after_checkpoint}", flush=True)
        kill_now()
    if args.kill_during_save is not None:
        run.train_until((args.kill_during_save - 1) * args.save_every)
        die_halfway_through_saves()  # the next checkpoint is number kill_during_save
    run.train_until(train_config.max_steps)

    trainer = run.trainer
    trainer.log()
    result = {
        "weights": trainer.model.state_dict(),
        "losses": [row["loss"] for row in trainer.history],
        "steps": [row["step"] for row in trainer.history],
        "lrs": [row["lr"] for row in trainer.history],
    }
    atomic_write(args.out, lambda temporary: torch.save(result, temporary))
    print(
        f"finished {trainer.step} steps, final loss {trainer.history[-1]['loss']:.4f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
