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
- ``torchrun_command`` / ``launch`` / ``launch_together``: start ``torchrun``
  jobs from Python (a notebook, a test) so that no process of the job outlives
  it, whether it succeeds, fails or hangs.

The gradient arithmetic itself (global token count, loss times world size,
``no_sync`` on all but the last micro-batch) lives in ``torchbook.train``.
"""

# No "from __future__ import annotations": DDP checks the comm hook's annotations
# at runtime and refuses them as strings.
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the job: its rank, the number of ranks, its device."""

    rank: int
    world_size: int
    device: torch.device
    backend: str


def backend_for(device: torch.device | str) -> str:
    """``"nccl"`` for CUDA devices, ``"gloo"`` otherwise (the CPU, on any machine)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(device_type: str) -> DistributedContext:
    """Join the process group ``torchrun`` set up, on ``"cpu"`` or ``"cuda"``.

    On CUDA each process takes the GPU numbered by its local rank (its index on
    its own machine, ``LOCAL_RANK``) and makes it the current device *before*
    joining: NCCL binds its communicator to the current device, and the global
    rank would name a GPU of another machine.
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(
            f"init_distributed: device_type must be 'cpu' or 'cuda', "
            f"got {device_type!r}"
        )
    if not dist.is_available():
        raise RuntimeError(
            "init_distributed: this PyTorch build has no torch.distributed"
        )
    device = torch.device(device_type)
    if device_type == "cuda":
        if "LOCAL_RANK" not in os.environ:
            raise RuntimeError(
                "init_distributed: LOCAL_RANK is not set; start the script "
                "with torchrun"
            )
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    backend = backend_for(device)
    # env://: the rank, world size and address torchrun set
    dist.init_process_group(backend)
    return DistributedContext(dist.get_rank(), dist.get_world_size(), device, backend)


def cleanup_distributed() -> None:
    """Destroy the process group if there is one (in ``finally``: on errors too)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_rank_zero() -> bool:
    """True in the one process that writes logs and checkpoints (or not distributed)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def rank_slice(batch: Tensor, rank: int, world_size: int) -> Tensor:
    """This rank's rows of ``batch``: ``[rank * n, (rank + 1) * n)``, n = rows / ranks.

    The global batch must divide evenly: ranks with different batch sizes would
    wait for each other at every all-reduce and weigh their tokens differently.
    """
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank_slice: expected 0 <= rank < world_size, "
            f"got rank={rank}, world_size={world_size}"
        )
    if batch.size(0) % world_size != 0:
        raise ValueError(
            f"rank_slice: a global batch of {batch.size(0)} rows does not split "
            f"evenly over {world_size} ranks"
        )
    rows = batch.size(0) // world_size
    return batch[rank * rows : (rank + 1) * rows]


class AllReduceCounter:
    """How many gradient all-reduces DDP has started, and each one's bucket size."""

    def __init__(self) -> None:
        self.calls = 0
        self.bucket_bytes: list[int] = []  # one entry per all-reduce, in order


def counting_allreduce_hook(
    state: AllReduceCounter, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: record the call and its bucket's bytes in ``state``,
    then do DDP's usual all-reduce (an average)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.calls += 1
    buffer = bucket.buffer()
    state.bucket_bytes.append(buffer.numel() * buffer.element_size())
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
    """``value`` averaged over all ranks (a copy; a collective: every rank calls it)."""
    total = value.detach().clone().float()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM)  # gloo has no AVG; divide by hand
        total /= dist.get_world_size()
    return total


def _local(tensor: Tensor) -> Tensor:
    """The part of ``tensor`` stored here (a DTensor's local shard, else itself)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def local_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes this rank stores for ``parameters`` and ``optimizer_state``."""
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


# Launching torchrun jobs from Python. POSIX only (``ps`` and signals); the
# marker that finds a job's orphans is read from Linux's /proc.

LAUNCH_TIMEOUT_S = 300.0  # a tiny job takes seconds; a hung collective must not hang
JOB_MARKER = "TORCHBOOK_JOB"  # set in a job's environment; every process inherits it


class LaunchError(RuntimeError):
    """A launched job failed or ran past its timeout; the message holds its output."""


def free_port() -> int:
    """A TCP port no one listens on now (the OS picks it when we bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(
    script: str | Path,
    args: Sequence[str] = (),
    nproc: int = 2,
    python: str = sys.executable,
) -> list[str]:
    """``torchrun`` on one machine with ``nproc`` processes and a free rendezvous port.

    An explicit free port rather than ``--master_port=0``: each rank would
    resolve port 0 on its own, and the ranks would never meet.
    """
    return [
        python,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(script),
        *map(str, args),
    ]


def torchrun_node_command(
    script: str | Path,
    args: Sequence[str],
    node_rank: int,
    nnodes: int,
    port: int,
    nproc_per_node: int = 1,
    python: str = sys.executable,
) -> list[str]:
    """One node's ``torchrun`` of a job whose nodes meet at a c10d rendezvous on
    127.0.0.1:``port``."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=book",
        str(script),
        *map(str, args),
    ]


def _process_tree(job: subprocess.Popen) -> set[int]:
    """The processes of ``job``'s process group and every one below them (``ps``)."""
    listing = subprocess.run(
        ["ps", "-A", "-o", "pid=", "-o", "ppid=", "-o", "pgid="],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    children: dict[int, list[int]] = {}
    todo = [job.pid] if job.returncode is None else []  # not reaped: still its pid
    for line in listing.splitlines():
        pid, ppid, group = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
        if group == job.pid:
            todo.append(pid)
    found = set()
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def _marked(job_id: str) -> set[int]:
    """Processes whose environment holds ``JOB_MARKER=job_id`` (none without /proc)."""
    entry = f"{JOB_MARKER}={job_id}".encode()
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if entry in environ.read_bytes().split(b"\0"):
                found.add(int(environ.parent.name))
        except OSError:  # another user's process, or it ended while we looked
            continue
    return found


class Job:
    """A command in a session of its own, its output collected in a temporary file.

    Why more than ``subprocess.run``: ``torchrun`` starts each worker in a
    session of its own, so killing ``torchrun``'s process group misses them; a
    worker's own children outlive a worker that fails (they are re-parented,
    out of reach of a walk down from ``torchrun``); and a pipe stays open as
    long as any of them holds it. So the output goes to a file, and every
    process carries a marker in its environment by which ``kill`` finds it.
    """

    def __init__(
        self,
        command: Sequence[str],
        cwd: str | Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.command = [str(part) for part in command]
        self.job_id = uuid.uuid4().hex
        self._output = tempfile.TemporaryFile(
            mode="w+", encoding="utf-8", errors="replace"
        )
        self.process = subprocess.Popen(
            self.command,
            stdout=self._output,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={**(os.environ if env is None else env), JOB_MARKER: self.job_id},
            start_new_session=True,
        )

    def output(self) -> str:
        self._output.seek(0)
        return self._output.read()

    def failure(self) -> LaunchError | None:
        """None while it runs or once it exited with 0; the error, with its output."""
        code = self.process.poll()
        if code in (None, 0):
            return None
        return LaunchError(
            f"{' '.join(self.command)} exited with code {code}; "
            f"output:\n{self.output()}"
        )

    def kill(self) -> None:
        """End the command and every process of the job, wherever it now hangs.

        Each process found (below the command, or carrying the job's marker) is
        stopped before anything is killed, so none can start another unseen.
        """
        stopped: set[int] = set()
        while True:
            found = _process_tree(self.process) | _marked(self.job_id)
            found -= stopped | {os.getpid()}
            if not found:
                break
            _signal(found, signal.SIGSTOP)
            stopped |= found
        _signal(stopped, signal.SIGKILL)
        self.process.wait()


def _signal(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # it ended meanwhile
            pass


def launch(
    command: Sequence[str],
    timeout_s: float = LAUNCH_TIMEOUT_S,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """Run ``command`` to the end and return its output; raise ``LaunchError`` on a
    failure or at the timeout.

    However it ends (an error in the caller and Ctrl-C included), no process it
    started is left running.
    """
    return launch_together([command], timeout_s, cwd, env)[0]


def launch_together(
    commands: Sequence[Sequence[str]],
    timeout_s: float = LAUNCH_TIMEOUT_S,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run ``commands`` at the same time (the nodes of one job); return their outputs.

    As soon as one fails, or at the timeout, every process of every command is
    killed and ``LaunchError`` raised: the job cannot finish without all of them.
    """
    deadline = time.monotonic() + timeout_s
    jobs = [Job(command, cwd, env) for command in commands]
    try:
        while any(job.process.poll() is None for job in jobs):
            failed = next((job.failure() for job in jobs if job.failure()), None)
            if failed:
                raise failed
            if time.monotonic() > deadline:
                outputs = "\n".join(job.output() for job in jobs)
                raise LaunchError(
                    f"{' '.join(jobs[0].command)} ran past {timeout_s:.0f} s and "
                    f"was killed; output:\n{outputs}"
                )
            time.sleep(0.1)
        failed = next((job.failure() for job in jobs if job.failure()), None)
        if failed:
            raise failed
        return [job.output() for job in jobs]
    finally:
        for job in jobs:  # on success too: a process its torchrun left behind
            job.kill()
