"""Start ``torchrun`` jobs (or any command) as subprocesses that always end, with no process left behind.

The chapters and the tests start the ``examples/`` scripts with these helpers;
they are plumbing, not a lesson. Why they are more than ``subprocess.run``:

- ``torchrun`` starts each worker in a session of its own, so killing
  ``torchrun``'s process group does not reach its workers, and killing
  ``torchrun`` first orphans them. ``Job.kill`` stops the whole tree of
  processes (so none can start another), then kills every one of them.
- The output goes to a temporary file, not a pipe: a pipe stays open as long
  as any process holding it lives, and waiting on it could outlast the timeout.

POSIX only (it lists processes with ``ps`` and signals them).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

LAUNCH_TIMEOUT_S = (
    300.0  # a tiny job takes seconds; a hung collective must not hang the caller
)


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
    """One node's ``torchrun`` of a multi-node job that meets at a c10d rendezvous on 127.0.0.1:``port``."""
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


def _ps(*columns: str) -> list[list[int]]:
    """One row of integers per process, the ``columns`` that ``ps -o`` names."""
    listing = subprocess.run(
        ["ps", "-A", *[f"-o{column}=" for column in columns]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [[int(value) for value in line.split()] for line in listing.splitlines()]


def _descendants(roots: set[int]) -> set[int]:
    """``roots`` and every process below them, alive now."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _ps("pid", "ppid"):
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def _signal(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # it ended meanwhile
            pass


class Job:
    """A command running in a session of its own, its output collected in a temporary file."""

    def __init__(
        self,
        command: Sequence[str],
        cwd: str | Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.command = [str(part) for part in command]
        self._output = tempfile.TemporaryFile(
            mode="w+", encoding="utf-8", errors="replace"
        )
        self.process = subprocess.Popen(
            self.command,
            stdout=self._output,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )

    def output(self) -> str:
        self._output.seek(0)
        return self._output.read()

    def failure(self) -> LaunchError | None:
        """None while it runs or once it exited with 0; the error, with its output, if it failed."""
        code = self.process.poll()
        if code in (None, 0):
            return None
        return LaunchError(
            f"{' '.join(self.command)} exited with code {code}; output:\n{self.output()}"
        )

    def kill(self) -> None:
        """End the command and every process it started, in its session or in sessions of their own.

        Each process found is stopped before anything is killed, so none can
        start another or be orphaned (and lost) by its parent's death.
        """
        stopped: set[int] = set()
        while True:
            # the job's group
            roots = {
                pid for pid, group in _ps("pid", "pgid") if group == self.process.pid
            }
            # not reaped yet, so its id is still its own
            if self.process.returncode is None:
                roots.add(self.process.pid)
            found = _descendants(roots) - stopped
            if not found:
                break
            _signal(found, signal.SIGSTOP)
            stopped |= found
        _signal(stopped, signal.SIGKILL)
        self.process.wait()


def launch(
    command: Sequence[str],
    timeout_s: float = LAUNCH_TIMEOUT_S,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """Run ``command`` to the end and return its output; on a failure or timeout, raise ``LaunchError``.

    However it ends (an error in the caller and Ctrl-C included), no process it started is left running.
    """
    return launch_together([command], timeout_s, cwd, env)[0]


def launch_together(
    commands: Sequence[Sequence[str]],
    timeout_s: float = LAUNCH_TIMEOUT_S,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run ``commands`` at the same time (the nodes of one job) and return each one's output.

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
                    f"{' '.join(jobs[0].command)} ran past {timeout_s:.0f} s and was killed; "
                    f"output:\n{outputs}"
                )
            time.sleep(0.1)
        failed = next((job.failure() for job in jobs if job.failure()), None)
        if failed:
            raise failed
        return [job.output() for job in jobs]
    finally:
        for job in jobs:  # on success too: a worker its torchrun left behind
            job.kill()
