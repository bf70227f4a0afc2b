"""The tensor memory of a run on fake tensors, tracked: PyTorch's ``MemTracker``.

A fake tensor (``torch._subclasses.fake_tensor.FakeTensorMode``) has a shape, a
dtype and a device but no data: each operation runs its shape rule instead of
its kernel. A training step of a 7B model then runs in seconds and almost no
memory, and every tensor it makes can still be counted. ``MemTracker`` (in
``torch.distributed._tools``; torchtitan's memory estimator runs it on fake
tensors) counts them: a dispatch mode sees each operation's outputs, adds the
bytes of every new storage and takes them off when the storage is freed,
follows ``UntypedStorage.resize_`` (with which FSDP2 frees its gathered
parameters), and keeps the peak. ``FSDPMemTracker`` is its subclass for FSDP2.

``PeakTracker`` is the book's one tracker: the calculator's check
(``torchbook.memory.check``) and the GPU job's dry run use it. It uses
``MemTracker``'s public API (``track_external`` for what existed before, the
context manager, ``get_tracker_snapshot``) and changes three things, each
because a run of the book needs it:

- MemTracker's statistics per module are off. To keep them it refuses a root
  module called twice (a dry run trains many steps), installs a gradient hook
  on every parameter of a module it enters (a frozen parameter, LoRA's base,
  refuses one) and after every operation walks every module it knows (which
  makes a 32-layer step several times slower). The whole run's peak needs
  none of it: every tensor is some operation's output.
- ``torch.compile`` compiles under it (``ignore_compile_internals``, an
  option of every dispatch mode): Dynamo runs a frame uncompiled under any
  other mode. The tracker sees the compiled graph's operations as they run.
- ``peak_bytes(step)`` gives the most bytes ``step()`` adds to those alive
  before it, so a run is tracked whole and its steps one by one.

Real tensors are counted with the fake ones. In the dry run
(``python examples/gpu_results.py --dry-run``) what is known without the
model stays real: the batches read from disk and the scalars (counters, the
loss scale, AdamW's step), which a GPU run holds on the device too.

What no tracker of tensors sees: memory a kernel allocates and frees inside
itself (its scratch), and everything outside the tensors (the CUDA context,
cuBLAS's workspaces, the caching allocator's rounding and cached blocks). So
a tracked peak is a lower bound of the allocator's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

TOTAL = "Total"  # the snapshot's key for all kinds of tensors together


class _WholeRun:
    """The changes to ``MemTracker`` (and ``FSDPMemTracker``) described above."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._windows: list[int] = []  # the peaks of open ``peak_bytes`` calls

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    # MemTracker's hooks for its statistics per module, switched off.
    def _pre_fw_hook(self, *args: Any) -> None:
        pass

    def _post_fw_hook(self, *args: Any) -> None:
        pass

    def _pre_bw_hook(self, *args: Any) -> None:
        pass

    def _post_bw_hook(self, *args: Any) -> None:
        pass

    def _update_peak_stats(self, peak_state: object) -> None:
        """After each operation: the run's peak, and each open window's."""
        live = 0
        for device, snapshot in self._curr_mem_snap.items():
            live += snapshot[TOTAL]
            if self._peak_mem.get(device, 0) < snapshot[TOTAL]:
                self._peak_mem[device] = snapshot[TOTAL]
                self._peak_mem_snap[device] = dict(snapshot)
        self._windows = [max(peak, live) for peak in self._windows]

    @property
    def live(self) -> int:
        """Bytes of the tracked tensors alive now."""
        snapshot = self.get_tracker_snapshot("current")
        return sum(device[TOTAL] for device in snapshot.values())

    @property
    def peak(self) -> int:
        """The most bytes of tracked tensors alive at once, since the tracker began."""
        snapshot = self.get_tracker_snapshot("peak")
        return sum(device[TOTAL] for device in snapshot.values())

    def peak_bytes(self, step: Callable[[], object]) -> int:
        """Most bytes ``step()`` adds at once to the tracked tensors alive before it.

        ``torchbook.memory.measure.peak_bytes`` measures the same of a real
        step, from the allocator's records.
        """
        before = self.live
        self._windows.append(before)
        try:
            step()
        finally:
            peak = self._windows.pop()
        return peak - before


class PeakTracker(_WholeRun, MemTracker):
    """``MemTracker`` for a whole run's peak, and its steps' (see the module)."""


def fsdp_tracker(model: torch.nn.Module, optimizer: object | None) -> MemTracker:
    """A ``PeakTracker`` for an FSDP2 model: ``FSDPMemTracker`` with the same changes.

    ``FSDPMemTracker`` counts the FSDP2 model's shards, its all-gathered
    parameters and its reduce-scattered gradients by their own hooks.
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = type("FSDPPeakTracker", (_WholeRun, FSDPMemTracker), {})
    return tracker(model, optimizer)


def fake_step_peak(build: Callable[[], Callable[[], object]]) -> int:
    """Peak bytes of one training step on fake tensors, once the optimizer has states.

    ``build()`` runs under fake tensors: it makes the model, the optimizer and
    a batch, and returns the step (forward, loss, backward, optimizer step,
    ``zero_grad``). The first step makes the optimizer's states, as a real
    run's does; the second is tracked. The peak counts every tensor alive:
    parameters, buffers, optimizer states and the batch too. For a model the
    calculator does not know, this is the answer without any formula.
    """
    with FakeTensorMode(allow_non_fake_inputs=True), PeakTracker() as tracker:
        step = build()
        step()
        return tracker.live + tracker.peak_bytes(step)
