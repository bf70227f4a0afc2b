"""The device helpers every module may need: precision dtypes, the accelerator, timing.

And the hardware named in words, for a timing or a provenance record.

A small module on purpose: the training loop and the measurements import it
without the profiles and their run sizes (``torchbook.book.profiles`` builds on it).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from typing import TypeVar

import torch

Result = TypeVar("Result")

# The one spelling of a run's precision: the dtype its forward pass autocasts to.
# "fp32" means no autocast; it is listed so every precision has a dtype.
AUTOCAST_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def autocast(device_type: str, precision: str) -> torch.autocast:
    """Autocast to ``precision``'s dtype on ``device_type``; ``"fp32"`` turns it off.

    The one spelling of the block every forward pass under a precision opens.
    """
    return torch.autocast(
        device_type, dtype=AUTOCAST_DTYPES[precision], enabled=precision != "fp32"
    )


def accelerator() -> torch.device | None:
    """The accelerator this machine has (CUDA first, then MPS), or None."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return None


def hardware_name(device: torch.device) -> str:
    """The hardware behind ``device`` in words: a timing means little without it.

    A CPU is named by the vector instructions PyTorch's kernels use
    (``get_cpu_capability``: avx2, avx512, ...), which decide how fast it computes
    in bf16, and its threads. Where those kernels are capped below what the CPU
    has (``ATEN_CPU_CAPABILITY``), both are named.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple MPS ({platform.machine()})"
    threads = torch.get_num_threads()
    plural = "s" if threads > 1 else ""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    native = _native_cpu_capability()
    if native is not None and native != capability:
        capability = f"{capability} kernels on an {native} CPU"
    return f"{platform.machine()} CPU ({capability}, {threads} thread{plural})"


def _native_cpu_capability() -> str | None:
    """The CPU's own widest vector extension, read from the CPU, not from ATen."""
    checks = [
        ("amx", "_is_amx_tile_supported"),
        ("avx512_bf16", "_is_avx512_bf16_supported"),
        ("avx512", "_is_avx512_supported"),
        ("avx2", "_is_avx2_supported"),
    ]
    for name, check in checks:
        supported = getattr(torch.cpu, check, None)
        if supported is not None and supported():
            return name
    return None


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished its queued work.

    CUDA and MPS run kernels asynchronously: without this, a timer reads how
    long the host took to queue the work, not how long the device took to do it.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(work: Callable[[], Result], device: torch.device) -> tuple[Result, float]:
    """Run ``work()`` and return its result with the seconds it took on ``device``.

    Synchronizes before starting the clock (earlier work is not counted) and
    before stopping it (this work is finished, not only queued).
    """
    synchronize(device)
    start = time.perf_counter()
    result = work()
    synchronize(device)
    return result, time.perf_counter() - start
