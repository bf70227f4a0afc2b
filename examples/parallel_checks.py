"""Train one GPT on the same global batches with DDP, then FSDP2; save a DCP checkpoint.

    python -m torch.distributed.run --nproc_per_node=2 examples/parallel_checks.py \
        --batches FILE --out DIR [--device cpu|cuda]

``--batches`` is a ``torch.save``d dict: ``x`` and ``y`` of shape
``(steps, accum_steps, global_rows, block_size)`` (``y`` may hold -100 for
ignored tokens), ``model`` (GPTConfig fields), ``train`` (TrainConfig fields)
and ``seed``. Each rank trains on its rows of every micro-batch (``rank_slice``).
Rank 0 writes, into ``--out``:

- ``ddp_weights.pt``: the DDP model's weights after the steps, to compare with
  one process trained on the whole global batches;
- ``fsdp_full.pt``: the FSDP2 model's weights gathered into one plain state_dict;
- ``dcp/``: the FSDP2 model and optimizer as a sharded ``torch.distributed.checkpoint``
  (every rank writes its own shards);
- ``results.json``: DDP's losses and gradient norms, FSDP2's losses, DTensor
  placements and shapes, bytes per rank, and the collectives of each run's
  last step, counted by ``CommDebugMode``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP

from torchbook.distributed import (
    DistributedContext,
    cleanup_distributed,
    init_distributed,
    is_rank_zero,
    local_bytes,
    rank_slice,
)
from torchbook.files import atomic_write, atomic_write_text
from torchbook.models import GPT, GPTConfig
from torchbook.train import TrainConfig, Trainer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batches",
        type=Path,
        required=True,
        help="the global batches (see the docstring)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="folder for rank 0's files and the DCP checkpoint",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="FSDP2 with bf16 parameters, gradients reduced in fp32",
    )
    return parser.parse_args()


def my_micro_batches(
    data: dict, step: int, context: DistributedContext
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of each micro-batch of ``step``."""
    return [
        (
            rank_slice(data["x"][step, k], context.rank, context.world_size),
            rank_slice(data["y"][step, k], context.rank, context.world_size),
        )
        for k in range(data["x"].size(1))
    ]


def train_steps(
    trainer: Trainer, data: dict, context: DistributedContext
) -> tuple[list, dict[str, int]]:
    """Every step's result, and how many collectives of each kind the last step ran."""
    steps = data["x"].size(0)
    results = [
        trainer.train_step(my_micro_batches(data, step, context))
        for step in range(steps - 1)
    ]
    with CommDebugMode() as collectives:  # counts the collectives this process starts
        results.append(trainer.train_step(my_micro_batches(data, steps - 1, context)))
    counts = {
        str(op).split(".")[-1].rstrip("_"): n
        for op, n in collectives.get_comm_counts().items()
    }
    return results, counts


def train_ddp(
    data: dict, context: DistributedContext
) -> tuple[GPT, list[float], list[float], dict[str, int]]:
    # The same seed on every rank, unlike train_ddp.py: FSDP2 below shards the weights
    # each rank makes, so they must agree, and without dropout training draws nothing.
    torch.manual_seed(data["seed"])
    model = GPT(GPTConfig(**data["model"])).to(context.device)
    ddp_model = DDP(
        model,
        device_ids=[context.device.index] if context.device.type == "cuda" else None,
    )
    trainer = Trainer(ddp_model, TrainConfig(**data["train"]), context.device)
    results, collectives = train_steps(trainer, data, context)
    # The gradient norm before clipping: the gradient itself, which AdamW would hide.
    return (
        model,
        [r.loss.item() for r in results],
        [r.grad_norm.item() for r in results],
        collectives,
    )


def train_fsdp(
    data: dict, context: DistributedContext, bf16: bool
) -> tuple[GPT, Trainer, list[float], dict]:
    torch.manual_seed(data["seed"])  # the same initial weights as the DDP run
    model = GPT(GPTConfig(**data["model"])).to(context.device)
    # bf16 parameters for the forward and backward, gradients reduced in fp32.
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else None
    )
    kwargs = {"mp_policy": policy} if policy is not None else {}
    # each block's weights are gathered just before it runs, freed after
    for block in model.blocks:
        fully_shard(block, **kwargs)
    # the rest: embedding (tied to the head) and the final LayerNorm
    fully_shard(model, **kwargs)
    trainer = Trainer(model, TrainConfig(**data["train"]), context.device)
    name, parameter = next(iter(model.named_parameters()))
    layout = {
        "name": name,
        "type": type(parameter).__name__,
        "placements": str(parameter.placements),
        "global_shape": list(parameter.shape),
        "local_shape": list(parameter.to_local().shape),
    }
    results, layout["collectives"] = train_steps(trainer, data, context)
    layout["bytes"] = local_bytes(model, trainer.optimizer)
    return model, trainer, [r.loss.item() for r in results], layout


def main() -> str:
    """Run both trainings on every rank; return the backend."""
    args = parse_args()
    context = init_distributed(args.device)
    try:
        run(args, context)
        # no rank tears down its process group while another still works
        torch.distributed.barrier()
    finally:
        cleanup_distributed()
    return context.backend


def run(args: argparse.Namespace, context: DistributedContext) -> None:
    started = time.perf_counter()
    data = torch.load(args.batches, weights_only=True)
    ddp_model, ddp_losses, ddp_grad_norms, ddp_collectives = train_ddp(data, context)
    fsdp_model, trainer, fsdp_losses, layout = train_fsdp(data, context, args.bf16)

    # A sharded checkpoint: every rank writes its own shards, and a metadata file
    # says where each piece is.
    model_state, optimizer_state = get_state_dict(fsdp_model, trainer.optimizer)
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=args.out / "dcp",
    )
    # The same weights gathered into one plain state_dict on rank 0 (a collective:
    # every rank calls it).
    full = get_model_state_dict(
        fsdp_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    bytes_per_rank = [None] * context.world_size
    torch.distributed.all_gather_object(bytes_per_rank, layout["bytes"])
    if not is_rank_zero():
        return
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write(
        args.out / "ddp_weights.pt",
        lambda path: torch.save(ddp_model.state_dict(), path),
    )
    atomic_write(args.out / "fsdp_full.pt", lambda path: torch.save(full, path))
    result = {
        "world_size": context.world_size,
        "backend": context.backend,
        "ddp_losses": ddp_losses,
        "ddp_grad_norms": ddp_grad_norms,
        "ddp_collectives": ddp_collectives,
        "fsdp_losses": fsdp_losses,
        "fsdp_parameter": layout,
        "bytes_per_rank": bytes_per_rank,
        "bf16": args.bf16,
        "seconds": time.perf_counter() - started,
    }
    atomic_write_text(args.out / "results.json", json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("ddp_losses", "fsdp_losses")}), flush=True)


if __name__ == "__main__":
    if main() == "gloo":
        # gloo's threads outlive destroy_process_group (torch 2.14), and a normal exit
        # aborts now and then in their teardown (see examples/ddp_minimal.py). Only
        # for gloo: os._exit also skips atexit handlers.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
