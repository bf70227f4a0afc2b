"""The pieces of multi-process training a script needs besides the model and the loop.

- ``backend_for`` / ``init_distributed`` / ``cleanup_distributed``: start and
  end the process group, with the backend the device needs (NCCL for CUDA,
  gloo for the CPU). ``init_distributed`` reads the rank and world size that
  ``torchrun`` publishes through ``init_process_group``'s default ``env://``.
- ``rank_slice``: this rank's share of a global batch (contiguous rows).
- ``count_allreduces``: a DDP communication hook that counts the gradient
  all-reduces, to see what ``no_sync`` saves.
- ``mean_over_ranks``: a value averaged across ranks, for logging.
- ``is_rank_zero``: only one process writes logs and checkpoints.
- ``local_bytes``: the bytes this rank holds for parameters and optimizer state
  (the local shards under FSDP2).

The gradient arithmetic itself (global token count, loss times world size,
``no_sync`` on all but the last micro-batch) lives in ``torchbook.train``.
"""

# No "from __future__ import annotations": DDP checks the comm hook's annotations at runtime
# and refuses them as strings.
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the job: its rank, the number of ranks, and its device."""

    rank: int
    world_size: int
    device: torch.device
    backend: str


def backend_for(device: torch.device | str) -> str:
    """``"nccl"`` for CUDA devices, ``"gloo"`` otherwise (the CPU; gloo also runs on any machine)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(device_type: str) -> DistributedContext:
    """Join the process group ``torchrun`` set up, on ``device_type`` (``"cpu"`` or ``"cuda"``).

    On CUDA each process takes the GPU numbered by its rank modulo the local
    GPU count (one process per GPU) and makes it the current device before any
    collective runs, so that NCCL does not put every rank on GPU 0.
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(
            f"init_distributed: device_type must be 'cpu' or 'cuda', got {device_type!r}"
        )
    if not dist.is_available():
        raise RuntimeError(
            "init_distributed: this PyTorch build has no torch.distributed"
        )
    device = torch.device(device_type)
    backend = backend_for(device)
    # env://: the rank, world size and address torchrun set
    dist.init_process_group(backend)
    if device_type == "cuda":
        # NCCL creates its communicators at the first collective, on the current device.
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return DistributedContext(dist.get_rank(), dist.get_world_size(), device, backend)


def cleanup_distributed() -> None:
    """Destroy the process group if there is one (call it in ``finally``, on errors too)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_rank_zero() -> bool:
    """True in the one process that writes logs and checkpoints (and when not distributed)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def rank_slice(batch: Tensor, rank: int, world_size: int) -> Tensor:
    """Rows ``[rank * n, (rank + 1) * n)`` of ``batch``, with ``n = len(batch) // world_size``.

    The global batch must divide evenly: ranks with different batch sizes would
    wait for each other at every all-reduce and weigh their tokens differently.
    """
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank_slice: expected 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
        )
    if batch.size(0) % world_size != 0:
        raise ValueError(
            f"rank_slice: a global batch of {batch.size(0)} rows does not split evenly over {world_size} ranks"
        )
    rows = batch.size(0) // world_size
    return batch[rank * rows : (rank + 1) * rows]


class AllReduceCounter:
    """How many gradient all-reduces DDP has started, and each one's bucket size (see ``count_allreduces``)."""

    def __init__(self) -> None:
        self.calls = 0
        self.bucket_bytes: list[int] = []  # one entry per all-reduce, in order


def counting_allreduce_hook(
    state: AllReduceCounter, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: record the call and its bucket's bytes in ``state``, then do DDP's
    usual all-reduce (an average)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.calls += 1
    state.bucket_bytes.append(bucket.buffer().numel() * bucket.buffer().element_size())
    return allreduce_hook(None, bucket)  # None: the default (world) process group


def count_allreduces(
    ddp_model: nn.parallel.DistributedDataParallel,
) -> AllReduceCounter:
    """Register the counting hook on ``ddp_model`` and return its counter.

    DDP groups gradients into buckets and all-reduces each bucket as soon as
    its gradients are ready, so the hook runs once per bucket per synchronised
    backward; a backward under ``no_sync()`` runs it zero times.
    """
    counter = AllReduceCounter()
    ddp_model.register_comm_hook(counter, counting_allreduce_hook)
    return counter


def mean_over_ranks(value: Tensor) -> Tensor:
    """``value`` averaged over all ranks (a copy; a collective, so every rank must call it)."""
    total = value.detach().clone().float()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM)  # gloo has no AVG; divide by hand
        total /= dist.get_world_size()
    return total


def _local(tensor: Tensor) -> Tensor:
    """The part of ``tensor`` stored in this process (a DTensor's local shard, else itself)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def local_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes this rank stores for ``parameters`` and ``optimizer_state`` (local shards only)."""
    parameters = sum(
        _local(p).numel() * _local(p).element_size() for p in model.parameters()
    )
    state = 0
    if optimizer is not None:
        for per_parameter in optimizer.state.values():
            for value in per_parameter.values():
                if isinstance(value, Tensor):
                    state += _local(value).numel() * _local(value).element_size()
    return {"parameters": parameters, "optimizer_state": state}
