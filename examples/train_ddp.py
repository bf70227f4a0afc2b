"""Train the book's GPT with DistributedDataParallel on every process torchrun starts.

    python -m torch.distributed.run --nproc_per_node=2 examples/train_ddp.py \
        --shards DIR --out DIR [--device cpu|cuda]

Each process is one rank: it joins the process group (gloo on the CPU, NCCL on
CUDA), reads its own share of the token blocks (``TokenStream`` with its rank),
wraps the model in DDP and trains with the book's ``Trainer``, which skips the
gradient all-reduce on all but the last micro-batch (``no_sync``), normalises
by the global target-token count and logs the loss averaged over the ranks.
A communication hook counts DDP's all-reduces. Each rank seeds its generators
with the seed plus its rank, as nanoGPT does, so that ranks draw different dropout
masks; DDP broadcasts rank 0's initial weights. Every rank hands its random states
to the training checkpoint, which rank 0 alone writes; rank 0 alone prints and
writes the log. Every rank waits at a barrier until rank 0 has written them, so the
ranks leave together; the process group is destroyed on the way out, on errors too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from torchbook.book.profiles import DeviceSizes, active_profile
from torchbook.checkpoint import save_training_checkpoint
from torchbook.data import StreamConfig, TokenStream
from torchbook.distributed import (
    DistributedContext,
    cleanup_distributed,
    count_allreduces,
    init_distributed,
    is_rank_zero,
    mean_over_ranks,
)
from torchbook.files import atomic_write_text
from torchbook.models import GPT, GPTConfig
from torchbook.shards import read_shards
from torchbook.train import TrainConfig, Trainer

# DDP all-reduces gradients in buckets of about this many megabytes (default 25). The
# book's tiny GPT would fit in one; small buckets show that the count is per bucket.
BUCKET_CAP_MB = 0.05


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shards",
        type=Path,
        required=True,
        help="folder written by torchbook.shards.write_shards",
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="folder for rank 0's log and training checkpoint",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="default: the active profile's device type",
    )
    return parser.parse_args()


def main() -> str:
    """Train on every rank; return the backend, which decides how the process exits."""
    args = parse_args()
    profile = active_profile()
    sizes = profile.devices
    context = init_distributed(args.device or profile.device.type)
    try:
        train(args, sizes, context)
        # no rank tears down its process group while another still works
        torch.distributed.barrier()
    finally:
        # on errors too: the other ranks are not left waiting at a collective
        cleanup_distributed()
    return context.backend


def train(
    args: argparse.Namespace, sizes: DeviceSizes, context: DistributedContext
) -> None:
    started = time.perf_counter()
    # Each rank its own seed, so that dropout masks differ across ranks; DDP copies
    # rank 0's initial weights to every rank when it wraps the model.
    torch.manual_seed(active_profile().seed + context.rank)
    model_config = GPTConfig(
        vocab_size=sizes.vocab_size,
        block_size=sizes.block_size,
        n_layer=sizes.n_layer,
        n_head=sizes.n_head,
        d_model=sizes.d_model,
    )
    # on its device before DDP and before the optimizer
    model = GPT(model_config).to(context.device)
    ddp_model = DDP(
        model,
        device_ids=[context.device.index] if context.device.type == "cuda" else None,
        bucket_cap_mb=BUCKET_CAP_MB,
    )
    # a communication hook that counts, then all-reduces
    counter = count_allreduces(ddp_model)

    # Each rank reads different batches: the stream deals global batches out by rank.
    stream = TokenStream(
        read_shards(args.shards),
        StreamConfig(
            block_size=sizes.block_size,
            batch_size=sizes.micro_batch_size,
            seed=1,
            rank=context.rank,
            world_size=context.world_size,
            epochs=None,
        ),
    )
    config = TrainConfig(
        max_steps=sizes.ddp_steps,
        lr=sizes.lr,
        min_lr=sizes.lr / 10,
        warmup_steps=2,
        accum_steps=sizes.accum_steps,
        log_every=sizes.ddp_steps // 3,
    )
    trainer = Trainer(ddp_model, config, context.device)
    batches = iter(stream)
    # DDP regroups its buckets after the first step; count every step
    allreduces_per_step = []
    while trainer.step < config.max_steps:
        calls_before = counter.calls
        # no_sync inside
        trainer.train_step(list(itertools.islice(batches, config.accum_steps)))
        allreduces_per_step.append(counter.calls - calls_before)
    # A checkpoint to resume from: every rank sends its random states (a collective),
    # rank 0 writes the file.
    checkpoint = save_training_checkpoint(
        args.out / "checkpoints",
        trainer.state_dict(),
        device=context.device,
        data_state=stream.state_dict(trainer.step * config.accum_steps),
        model_config=model_config,
    )
    # bytes of each bucket
    last_step_buckets = counter.bucket_bytes[-allreduces_per_step[-1] :]
    # a row every log_every steps, the loss averaged over all ranks' tokens
    history = trainer.history

    # The same accumulation by hand without no_sync: DDP all-reduces every micro-batch.
    counter.calls = 0
    for x, y in itertools.islice(batches, sizes.accum_steps):
        logits = ddp_model(x.to(context.device))
        F.cross_entropy(logits.flatten(0, 1), y.to(context.device).flatten()).backward()
    unsynced_per_step = counter.calls
    ddp_model.zero_grad(set_to_none=True)

    # Each rank evaluates its own next batch; the mean over ranks is what rank 0 logs.
    x, y = next(batches)
    with torch.no_grad():
        local_loss = F.cross_entropy(
            ddp_model(x.to(context.device)).flatten(0, 1),
            y.to(context.device).flatten(),
        )
    val_loss = mean_over_ranks(local_loss).item()
    # Every rank's own numbers, collected on rank 0 (a collective: all ranks call it),
    # so that one process prints and lines from different ranks never interleave.
    per_rank = [None] * context.world_size
    torch.distributed.all_gather_object(per_rank, (counter.calls, local_loss.item()))
    if not is_rank_zero():
        return
    for row in history:
        print(f"step {row['step']:3d}  loss {row['loss']:.4f}  lr {row['lr']:.2e}")
    for rank, (calls, loss) in enumerate(per_rank):
        print(f"rank {rank}: {calls} all-reduces unsynced, own loss {loss:.4f}")
    result = {
        "world_size": context.world_size,
        "backend": context.backend,
        "steps": trainer.step,
        "accum_steps": sizes.accum_steps,
        "history": history,
        "allreduces_per_step_with_no_sync": allreduces_per_step,
        "bucket_cap_mb": BUCKET_CAP_MB,
        "bucket_bytes_last_step": last_step_buckets,
        "allreduces_per_step_without_no_sync": unsynced_per_step,
        "val_loss_mean_over_ranks": val_loss,
        "val_loss_rank0": local_loss.item(),
        "seconds": time.perf_counter() - started,
    }
    atomic_write_text(args.out / "log.json", json.dumps(result, indent=1) + "\n")
    print(f"rank 0 wrote log.json and checkpoints/{checkpoint.name}", flush=True)


if __name__ == "__main__":
    if main() == "gloo":
        # gloo's threads outlive destroy_process_group (torch 2.14), and a normal exit
        # aborts now and then in their teardown (see examples/ddp_minimal.py). Only
        # for gloo: os._exit also skips atexit handlers.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
