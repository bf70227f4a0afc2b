"""A training step's memory, measured without any formula.

``torchbook.memory.gpt`` predicts; this module measures, so that the two can
be set side by side. It builds on ``torchbook.loss`` (``summed_loss``, the
book's forward and loss), ``torchbook.device``, and the package's
``__init__.py`` for the names of the two loops it runs (no formula).

- ``state_bytes``: the bytes of the tensors that exist (parameters, their
  gradients, the optimizer's states), each storage counted once;
- ``saved_activation_bytes``: a ``saved_tensors_hooks`` pack hook sees every
  tensor autograd saves for the backward pass (and, with
  ``respect_saved_tensors_hooks=True``, what selective checkpointing keeps);
- ``peak_bytes``: the most bytes a step allocates at once, from the
  allocator's own records;
- ``ddp_bucket_bytes``: what DistributedDataParallel keeps on two CPU ranks, with
  ``keep_bucket``, a communication hook that records its buckets;
- ``growing_batch``: what CUDA's caching allocator reserves when a step's
  tensors double in size.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from torchbook.device import autocast, synchronize
from torchbook.loss import summed_loss
from torchbook.memory import LOOPS


def training_loss(
    model: nn.Module,
    idx: torch.Tensor,
    targets: torch.Tensor,
    precision: str,
    loss_chunks: int = 1,
) -> torch.Tensor:
    """Mean loss of the book's training forward: ``summed_loss`` over the tokens."""
    return summed_loss(model, idx, targets, precision, loss_chunks) / targets.numel()


def training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    idx: torch.Tensor,
    targets: torch.Tensor,
    precision: str,
    loop: str = "trainer",
    loss_chunks: int = 1,
) -> None:
    """One step: forward, loss, backward, optimizer step, ``zero_grad``.

    ``loop="trainer"`` is the book's ``Trainer``: the logits are local to
    ``summed_loss`` and freed once the loss exists. ``loop="tutorial"`` is the
    tutorial version, ``logits = model(x)`` in the loop's own scope, which keeps
    the logits alive until the step ends.
    """
    if loop not in LOOPS:
        raise ValueError(f"training_step: loop={loop!r}; expected one of {LOOPS}")
    if loop == "trainer":
        training_loss(model, idx, targets, precision, loss_chunks).backward()
    else:
        with autocast(idx.device.type, precision):
            logits = model(idx)
        loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``; a shared one counts once."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
    }
    return sum(storages.values())


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Exact bytes of the parameters, their gradients and the optimizer's states."""
    parameters = list(model.parameters())
    states = [
        v
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]
    return {
        "parameters": storage_bytes(parameters),
        "gradients": storage_bytes(p.grad for p in parameters if p.grad is not None),
        "optimizer_states": storage_bytes(states),
    }


def saved_activation_bytes(
    model: nn.Module, forward: Callable[[], torch.Tensor]
) -> int:
    """Bytes of the tensors autograd saves while ``forward()`` runs, each storage once.

    Parameters and buffers are saved too (a Linear keeps its weight), but they
    exist anyway; they are left out so the count is the memory the step adds.
    """
    existing = {
        t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]
    }
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in existing:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = forward()
    del loss  # frees the graph
    return sum(saved.values())


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence stderr: Kineto, the profiler's engine, writes status lines there."""
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def allocation_totals(run: Callable[[], object]) -> list[int]:
    """Bytes allocated by ``run()`` after each allocation and free, in order (CPU).

    The profiler's memory records carry the allocator's running total for the
    whole process, so an earlier profiled run that left tensors alive shifts
    it. Each total here is taken relative to the one before the region's first
    event: the bytes ``run()`` itself holds at that moment.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with (
        _quiet_stderr(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler,
    ):
        run()
    events, pending = (
        [],
        list(profiler.profiler.kineto_results.experimental_event_tree()),
    )
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields))
    events.sort(key=lambda pair: pair[0])
    if not events:
        return [0]
    first = events[0][1]
    before = first.total_allocated - first.alloc_size
    return [fields.total_allocated - before for _, fields in events]


def peak_bytes(step: Callable[[], object], device: torch.device) -> int:
    """Most bytes ``step()`` has allocated at once, above what was allocated before it.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: ``allocation_totals``.
    Add the tensors that already existed (parameters, optimizer states:
    ``state_bytes``) for the step's whole footprint. MPS is refused: the
    profiler would measure host memory there, not the GPU's.
    """
    device = torch.device(device)
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    if device.type != "cpu":
        raise ValueError(
            f"peak_bytes: device {device} is not measured; the profiler's records "
            "are the host's memory, so only 'cpu' and 'cuda' are supported"
        )
    return max(0, *allocation_totals(step))


MiB = 2**20


def growing_batch(device: str = "cuda") -> tuple[int, int]:
    """Peak bytes allocated and reserved when a step's tensors double in size.

    Eight 16 MiB tensors are made and freed, then four of 32 MiB: the same
    bytes, as when a batch follows one of half its size. Set
    ``PYTORCH_CUDA_ALLOC_CONF`` before the process first touches CUDA.
    """
    if torch.device(device).type != "cuda":
        raise ValueError(f"growing_batch: device {device!r} is not CUDA")
    torch.cuda.reset_peak_memory_stats(device)
    for size, count in ((16 * MiB, 8), (32 * MiB, 4)):  # 128 MiB each time
        batch = [
            torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)
        ]
        del batch  # freed; the allocator keeps the blocks for the next batch
    peak = torch.cuda.max_memory_allocated(device)
    return peak, torch.cuda.max_memory_reserved(device)


# No annotations: DDP checks them against its own types, and this module's
# annotations are strings (from __future__ import annotations).
def keep_bucket(buckets, bucket):
    """A DDP communication hook: records its bucket in ``buckets``, sends nothing.

    The bucket comes back as it is: the bytes DDP keeps, without communication.
    """
    buckets.append(bucket.buffer())
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _ddp_bytes(model: nn.Module, idx: torch.Tensor, bucket_view: bool) -> str:
    """Bytes kept once DDP is built, and after one forward and backward."""
    from torch.nn.parallel import DistributedDataParallel

    ddp: list[nn.Module] = []  # keeps the module, and its buckets, alive
    # No communication is counted: init_sync=False skips the broadcast of the
    # weights, and the hook below the all-reduce. With them, the bytes read high
    # now and then (a built DDP once twice its buckets).
    built = allocation_totals(
        lambda: ddp.append(
            DistributedDataParallel(
                model, gradient_as_bucket_view=bucket_view, init_sync=False
            )
        )
    )
    ddp[0].register_comm_hook([], keep_bucket)
    backward = allocation_totals(
        lambda: training_loss(ddp[0], idx, idx.roll(-1, 1), "fp32").backward()
    )
    model.zero_grad(set_to_none=True)
    return f"{bucket_view} {built[-1]} {backward[-1]}"


def _ddp_rank(
    rank: int, port: int, model: nn.Module, folder: str, bucket_view: bool
) -> None:
    """One of two gloo ranks: ``_ddp_bytes`` for one setting, in a fresh process."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    address = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2)
    idx = torch.randint(0, model.config.vocab_size, (2, model.config.block_size))
    row = _ddp_bytes(model, idx, bucket_view)
    if rank == 0:
        with open(os.path.join(folder, f"ddp-{bucket_view}.txt"), "w") as file:
            file.write(row)
    dist.destroy_process_group()


def ddp_bucket_bytes(
    model: nn.Module, port: int = 29531
) -> dict[bool, tuple[int, int]]:
    """Bytes DDP keeps on two CPU ranks (gloo), by ``gradient_as_bucket_view``.

    For each setting: (bytes kept once ``DistributedDataParallel(model)`` is
    built: its gradient buckets; bytes a forward and backward leave: the
    gradients, unless they are views of the buckets). ``model`` is a GPT. Each
    setting runs in processes of its own, so nothing of the other is alive.
    """
    import tempfile

    import torch.multiprocessing as mp

    lines = []
    with tempfile.TemporaryDirectory() as folder:
        for offset, bucket_view in enumerate((False, True)):
            arguments = (port + offset, model, folder, bucket_view)
            mp.spawn(_ddp_rank, args=arguments, nprocs=2)
            with open(os.path.join(folder, f"ddp-{bucket_view}.txt")) as file:
                lines.append(file.read())
    results = {}
    for line in lines:
        view, built, backward = line.split()
        results[view == "True"] = (int(built), int(backward))
    return results
