"""The GPU job without a GPU: its own run functions on fake tensors, peak tracked.

A fake tensor (``torch._subclasses.fake_tensor.FakeTensorMode``) has a shape,
a dtype and a device but no data: each operation runs its shape rule instead
of its kernel. A step of GPT-2 small at 8 x 2,048 tokens then takes a second
and almost no memory, yet meets every shape, dtype and autocast cast of the
real one. ``FakeRun`` runs whole scripts this way, so that ``make gpu-results
DRY_RUN=1`` calls the same run functions as the GPU job, and a change that
breaks the job breaks the dry run.

What a fake tensor cannot do is give a value. ``FakeRun`` keeps a tensor real
where its value is known without the model: the data read from disk, scalars
(counters, the loss scale, AdamW's step) and whatever is computed from those
alone. A tensor computed from the model is fake, and reading one (``.item()``,
``.tolist()``, ``torch.equal``) gives a placeholder, 1, counted by caller.
``isfinite`` of a fake tensor is taken to be true (and ``isnan``, ``isinf``
false): fake values are assumed healthy, so the NaN check and the fp16
scaler's overflow check take their normal path. ``SWITCHED`` lists what the
dry run does instead of what cannot run on fake tensors; the dry run prints it.

The run's memory is tracked by the book's one tracker,
``torchbook.memory.tracker.PeakTracker`` (PyTorch's ``MemTracker``), which
``fake_run`` enters over the fake mode: the bytes of every tensor an operation
returns, until it is freed, and their peak. A kernel's own scratch (what it
allocates and frees inside itself, such as the CPU attention backward's
buffers or a bf16 matmul's temporary copies) is not a tensor any operation
returns, so the peak is a lower bound: the real one exceeds it by at most the
largest scratch of one kernel. ``tests/test_dry_run.py`` measures both sides.

The fake tensors are on the CPU. Fake CUDA tensors need a CUDA driver: on a
machine without one, autocast switches itself off for ``"cuda"`` and the
backward pass fails in the autograd engine. So the fake step takes the CPU's
paths: its autocast lists and its attention kernels (with dropout, the math
path).

It builds on ``torchbook.book.charlm`` (chapter 3's configs), ``torchbook.models``,
``torchbook.train``, ``torchbook.book.lab`` (the MLP and its epoch),
``torchbook.memory``, ``torchbook.memory.gpt`` and ``torchbook.book.gpu_fit``
(the formulas), ``torchbook.memory.tracker`` (the memory),
``torchbook.memory.measure`` (chapter 7's training step) and
``torchbook.book.profiles`` (the gpu sizes).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    is_fake,
)
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from torchbook.book import lab
from torchbook.book.charlm import model_config, train_config
from torchbook.book.gpu_fit import mlp_peak
from torchbook.book.profiles import Profile
from torchbook.memory import TrainingSetup
from torchbook.memory.gpt import predict_peak
from torchbook.memory.measure import training_step
from torchbook.memory.tracker import PeakTracker
from torchbook.models import GPT, GPTConfig
from torchbook.train import Trainer

# The fake tensors' device: fake CUDA needs a CUDA driver (see above).
FAKE_DEVICE = torch.device("cpu")
PLACEHOLDER = 1  # what reading a fake value gives: 1, 1.0 or True by its dtype
# What cannot run on fake tensors, and what the dry run does instead.
SWITCHED = {
    "values read from the model (.item(), .tolist(), torch.equal)": (
        "a placeholder, 1; values from the data and from counters are computed for real"
    ),
    "the kernels Inductor generates (torch.compile)": (
        "the aot_eager backend: Dynamo and AOTAutograd capture the same forward "
        "and backward graphs, which then run on fake tensors"
    ),
    "drill 6: torch.save and safetensors (they write the tensors' bytes)": "not run",
    "Module.to(device) (torch cannot swap fake parameters)": (
        "nothing: the fake tensors are already on the one fake device"
    ),
    "peak memory (the allocator's records)": (
        "the bytes of the tensors each operation returns, tracked as they are "
        "created and freed (torchbook.memory.tracker)"
    ),
    "timings, tokens per second and MFU": (
        "measured, but of fake operations: meaningless"
    ),
}
_READS = {
    torch.ops.aten._local_scalar_dense.default,  # .item(), .tolist(), float(t)
    torch.ops.aten.equal.default,
}
_ASSUMED = {  # a fake tensor's values are taken to be finite (isfinite: see below)
    torch.ops.aten.isnan.default: False,
    torch.ops.aten.isinf.default: False,
}
# The fp16 scaler's overflow check: with finite values it finds nothing, so the
# flag it writes into stays the real 0 it was.
_FINITE_CHECK = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
# torch.compile's warning about the tracker's global module hooks (see fake_run)
GLOBAL_HOOKS_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"
# the originals of what ``fake_run`` switches
_COMPILE, _MODULE_TO, _ISFINITE = torch.compile, nn.Module.to, torch.isfinite


class DryRunError(RuntimeError):
    """A part of the run needs values that fake tensors do not have."""


def _caller() -> str:
    """The first function outside torch and this module on the stack, by name."""
    frame = sys._getframe(1)
    torch_root = str(Path(torch.__file__).parent)
    while frame is not None and (
        frame.f_code.co_filename.startswith(torch_root)
        or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    function = frame.f_code.co_qualname.partition(".<locals>")[0]
    return f"{frame.f_globals.get('__name__', '?')}.{function}"


class FakeRun(FakeTensorMode):
    """Fake tensors for what the model computes; real ones for data and scalars.

    ``placeholders`` counts the values read from fake tensors, by caller;
    ``memory`` tracks the tensors' bytes once ``fake_run`` has entered it.
    """

    def __init__(self) -> None:
        # the data a run reads from disk is real, and becomes fake when it meets
        # the model
        super().__init__(allow_non_fake_inputs=True)
        self.memory = PeakTracker()
        self.placeholders: Counter[str] = Counter()
        self._written: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._depth = 0  # > 0 inside a fake kernel, which may call operations

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if self._depth:  # a fake kernel's own steps: its scratch, not counted
            return super().__torch_dispatch__(func, types, args, kwargs)
        tensors = [
            t for t in pytree.arg_tree_leaves(*args, **kwargs) if torch.is_tensor(t)
        ]
        unknown = not all(map(self.known, tensors))
        if func in _READS:
            return self._read(func, args, kwargs, unknown)
        if func in _ASSUMED and unknown and tensors[0].numel() <= 1:
            return torch.full(tensors[0].shape, _ASSUMED[func])
        if not unknown and tensors:
            return func(*args, **kwargs)  # every input is known: compute it
        self._depth += 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            raise DryRunError(
                f"{func} in {_caller()}: its result depends on values computed "
                "from the model, which fake tensors do not have"
            ) from None
        finally:
            self._depth -= 1
        if not tensors and all(
            t.numel() <= 1 for t in pytree.tree_leaves(out) if torch.is_tensor(t)
        ):
            return func(*args, **kwargs)  # a new scalar (a counter): real
        if func is not _FINITE_CHECK:
            self._note_writes(func, args, kwargs)
        return out

    def known(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` holds real values: not fake, nor written by a fake op."""
        return not is_fake(tensor) and tensor not in self._written

    def _read(self, func, args, kwargs, unknown: bool) -> Any:
        """A value read to the host: computed if known, else the placeholder."""
        if not unknown:
            return func(*args, **kwargs)
        self.placeholders[_caller()] += 1
        if func is torch.ops.aten.equal.default or args[0].dtype == torch.bool:
            return bool(PLACEHOLDER)
        return float(PLACEHOLDER) if args[0].is_floating_point() else PLACEHOLDER

    def _note_writes(self, func, args, kwargs) -> None:
        """Mark the real tensors this fake operation wrote into: now unknown."""
        schema = func._schema
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            for tensor in pytree.tree_leaves(value):
                if torch.is_tensor(tensor) and not is_fake(tensor):
                    self._written[tensor] = True


def _traced_only(model: Any = None, **options: Any) -> Any:
    """``torch.compile`` on the aot_eager backend, whatever backend was asked for."""
    for inductor_only in ("backend", "mode", "options"):
        options.pop(inductor_only, None)
    return _COMPILE(model, backend="aot_eager", **options)


def _assumed_finite(mode: FakeRun, tensor: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite``; true for a scalar computed from the model (see above).

    ``isfinite`` is a composition of comparisons, which ``FakeRun`` never sees
    as one operation; so it is switched here, where its name is known.
    """
    if tensor.numel() <= 1 and not mode.known(tensor):
        return torch.ones(tensor.shape, dtype=torch.bool)  # a new scalar: real
    return _ISFINITE(tensor)


def _to_on_fake_device(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    """``Module.to``, except that a move to the fake device is left out.

    ``Module.to`` swaps each fake parameter for a new one, which fails: torch
    keeps a weak reference to every fake tensor. On the one fake device the
    move changes nothing.
    """
    device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
    if dtype is None and (device is None or device.type == FAKE_DEVICE.type):
        return module
    return _MODULE_TO(module, *args, **kwargs)


def _drill_6_not_run(*args: Any, **kwargs: Any) -> dict[str, float]:
    """Drill 6 writes the tensors' bytes, which fake tensors do not have."""
    return {}


@contextlib.contextmanager
def fake_run() -> Iterator[FakeRun]:
    """A ``FakeRun`` entered, with what cannot run on fake tensors switched.

    ``torch.compile`` traces with aot_eager instead of generating Inductor's
    kernels, a model's move to the fake device is left out, and drill 6
    (saving and reloading the lab's model) does not run. The tracker's module
    hooks (``MemTracker`` tells forward from backward with them) make
    ``torch.compile(module)`` warn that global hooks fire once more for the
    compiled wrapper; they record nothing here, so the warning is silenced.
    """
    mode = FakeRun()

    def finite(tensor: torch.Tensor) -> torch.Tensor:  # a function: a method too
        return _assumed_finite(mode, tensor)

    with (
        warnings.catch_warnings(),
        mode,
        mode.memory,  # over the fake mode: it sees what each operation returns
        torch.device(FAKE_DEVICE),
        mock.patch.object(torch, "isfinite", finite),
        mock.patch.object(torch.Tensor, "isfinite", finite),
        mock.patch.object(torch, "compile", _traced_only),
        mock.patch.object(nn.Module, "to", _to_on_fake_device),
        mock.patch.object(lab, "save_and_reload", _drill_6_not_run),
    ):
        warnings.filterwarnings("ignore", message=GLOBAL_HOOKS_WARNING)
        yield mode


# ----- single training steps, for the formula's check (the appendix, the tests) -----

# A step builder returns the model and optimizer whose memory is tracked, and the step.
Built = tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]


@dataclass(frozen=True)
class GpuStep:
    """One training step the book takes on a GPU, as a builder of its fake version.

    ``formula_cpu`` is ``predict_peak`` with the CPU's kernels, which the fake
    step runs; ``formula_cuda`` with CUDA's, which the fit table uses.
    """

    name: str
    build: Callable[[], Built]  # called under the fake mode
    formula_cpu: int
    formula_cuda: int


def fake_peak_bytes(build: Callable[[], Built]) -> int:
    """Peak bytes of one training step on fake tensors, once AdamW has its states.

    The first step makes the optimizer's states (as a real run's first step
    does); the second is tracked. The peak counts every tensor alive: the
    parameters, buffers, optimizer states and the batch too, as a GPU's
    allocator would count them. ``torchbook.memory.tracker.fake_step_peak``
    does the same under a plain fake mode.
    """
    with fake_run() as mode:
        _, _, step = build()
        step()
        return mode.memory.live + mode.memory.peak_bytes(step)


def gpt_step(
    config: GPTConfig, batch_size: int, precision: str, loop: str = "trainer"
) -> GpuStep:
    """Chapter 7's step (``loop``'s ``training_step``, fused AdamW) for ``config``."""

    def build() -> Built:
        model = GPT(config).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        idx = torch.randint(0, config.vocab_size, (batch_size, config.block_size))
        targets = idx.roll(-1, dims=1)
        step = partial(training_step, model, optimizer, idx, targets, precision, loop)
        return model, optimizer, step

    name = f"ch. 7 GPT, {batch_size} x {config.block_size}, {precision}, {loop} loop"
    return GpuStep(name, build, *formulas(config, batch_size, precision, loop))


def formulas(
    config: GPTConfig, batch_size: int, precision: str, loop: str = "trainer"
) -> tuple[int, int]:
    """``predict_peak`` with the CPU's attention kernels and with CUDA's."""
    return tuple(
        predict_peak(
            config,
            TrainingSetup(
                batch_size, config.block_size, precision, loop=loop, kernels=kernels
            ),
        )
        for kernels in ("cpu", "cuda")
    )


def gpu_steps(profile: Profile, char_vocab_size: int) -> dict[str, GpuStep]:
    """The training steps of the GPU runs at ``profile``'s sizes, by run.

    ``char_vocab_size`` is the corpus's number of characters (chapter 3's
    vocabulary). Chapter 7's run is measured in bf16 and in float32, as the
    chapter runs it.
    """
    lm, memory, sizes = profile.lm, profile.memory, profile.lab
    lm_config = model_config(char_vocab_size, lm)

    def lm_build() -> Built:
        trainer = Trainer(GPT(lm_config), train_config(lm, profile.precision), "cpu")
        shape = (lm.batch_size, lm.block_size)
        batch = torch.randint(0, char_vocab_size, shape)
        targets = torch.randint(0, char_vocab_size, shape)
        return (
            trainer.model,
            trainer.optimizer,
            partial(trainer.train_step, [(batch, targets)]),
        )

    def lab_build() -> Built:
        model = lab.MnistMLP(sizes.hidden)
        optimizer, scheduler = lab.lab_optimizer("adamw", model, sizes, total_steps=2)
        images = torch.randn(sizes.batch_size, 1, 28, 28)
        labels = torch.randint(0, 10, (sizes.batch_size,))
        generator = torch.Generator().manual_seed(profile.seed)
        step = partial(
            lab.train_epoch,
            model,
            optimizer,
            scheduler,
            images,
            labels,
            sizes.batch_size,
            generator,
        )
        return model, optimizer, step

    longest = GPTConfig(
        memory.vocab_size,
        max(memory.seq_lens),
        memory.n_layer,
        memory.n_head,
        memory.d_model,
    )
    lab_peak = mlp_peak((28 * 28, *sizes.hidden, 10), sizes.batch_size)
    lm_name = f"ch. 3 language model, {lm.batch_size} x {lm.block_size}"
    return {
        "lm": GpuStep(
            f"{lm_name}, {profile.precision}",
            lm_build,
            *formulas(lm_config, lm.batch_size, profile.precision),
        ),
        "lab": GpuStep(
            f"ch. 10 lab MLP, batch {sizes.batch_size}", lab_build, lab_peak, lab_peak
        ),
        "memory": gpt_step(longest, memory.batch_size, profile.precision),
        # chapter 7's largest float32 cell: the tutorial loop keeps the logits
        "memory-fp32": gpt_step(longest, memory.batch_size, "fp32", "tutorial"),
    }
