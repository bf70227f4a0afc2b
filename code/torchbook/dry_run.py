"""The book's GPU training steps at full size, without a GPU: shapes and peak memory.

A fake tensor (``torch._subclasses.fake_tensor.FakeTensorMode``) has a shape,
a dtype and a device but no data: each operation runs its shape rule instead
of its kernel. A step of GPT-2 small at 8 x 2,048 tokens then takes seconds
and almost no memory, yet meets every shape, dtype and autocast cast of the
real one. ``MemTracker`` (``torch.distributed._tools``, the tracker
torchtitan's memory estimator runs under fake tensors) follows the bytes of
each tensor as the step creates and frees it, and reports the peak: set
beside ``memory.predict_peak``, it checks the formula without a GPU.

The fake tensors are on the CPU. Fake CUDA tensors need a CUDA driver: on a
machine without one, autocast switches itself off for ``"cuda"`` and the
backward pass fails in the autograd engine. So the fake step takes the CPU's
paths: its autocast lists and its attention kernels (with dropout, the math
path). Anything that reads a value cannot run on fake tensors (``.item()``,
``.tolist()``, a check of the data, a sampled token); ``GPT.forward`` skips its
token-id check for them.

It builds on ``torchbook.models``, ``torchbook.train`` (the Trainer),
``torchbook.lab`` (the MLP and its epoch), ``torchbook.memory`` and
``torchbook.gpu_fit`` (the formulas), ``torchbook.memory_measure`` (chapter 7's
training step) and ``torchbook.profiles`` (the gpu sizes).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from torchbook.gpu_fit import mlp_peak
from torchbook.lab import MnistMLP, lab_optimizer, train_epoch
from torchbook.memory import TrainingShape, predict_peak
from torchbook.memory_measure import training_step
from torchbook.models import GPT, GPTConfig
from torchbook.profiles import Profile
from torchbook.train import TrainConfig, Trainer

# The fake tensors' device: fake CUDA needs a CUDA driver (see above).
FAKE_DEVICE = torch.device("cpu")
# A step builder returns the model and optimizer whose memory is tracked, and the step.
Built = tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]


@dataclass(frozen=True)
class GpuStep:
    """One training step the book takes on a GPU, as a builder of its fake version.

    ``formula`` is ``predict_peak`` with the CPU's kernels, which the fake step
    runs; ``formula_cuda`` with CUDA's, which the fit table uses.
    """

    name: str
    build: Callable[[], Built]  # called under the fake mode
    formula: int
    formula_cuda: int


def fake_peak_bytes(build: Callable[[], Built]) -> int:
    """Peak bytes of one training step on fake tensors, once AdamW has its states.

    The first step makes the optimizer's states (as a real run's first step
    does); the second is tracked. The peak includes the parameters, buffers
    and optimizer states, as a GPU's allocator would count them.
    """
    with FakeTensorMode(), torch.device(FAKE_DEVICE):
        model, optimizer, step = build()
        step()
        # imported here: it pulls in half of torch.distributed (seconds)
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker, warnings.catch_warnings():
            # its module hooks are global, which torch.compile warns about; the
            # peak is counted per operation, so a hook firing twice changes nothing
            warnings.filterwarnings("ignore", "Using `torch.compile.module.` when")
            step()
    return tracker.get_tracker_snapshot("peak")[FAKE_DEVICE]["Total"]


def gpt_step(
    config: GPTConfig, batch_size: int, precision: str, loop: str = "trainer"
) -> GpuStep:
    """Chapter 7's step (``loop``'s ``training_step``, fused AdamW) for ``config``."""

    def build() -> Built:
        model = GPT(config).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        idx = torch.randint(0, config.vocab_size, (batch_size, config.block_size))
        targets = idx.roll(-1, dims=1)

        def step() -> None:
            training_step(model, optimizer, idx, targets, precision, loop)

        return model, optimizer, step

    name = f"ch. 7 GPT, {batch_size} x {config.block_size}, {precision}, {loop} loop"
    return GpuStep(name, build, *formulas(config, batch_size, precision, loop))


def trainer_step(
    config: GPTConfig,
    batch_size: int,
    train: TrainConfig,
    compile_backend: str | None = None,
) -> GpuStep:
    """Chapter 3's step: the book's ``Trainer`` (clipping, fused AdamW, schedule).

    With ``compile_backend`` the model runs under ``torch.compile``. The first,
    untracked step compiles: "aot_eager" captures the forward and backward
    graphs at full size, without generating kernels (Inductor's are the GPU's
    to make). The tracked step runs eagerly, since Dynamo leaves a frame alone
    while a dispatch mode such as ``MemTracker`` is active: its peak is the
    eager step's.
    """

    def build() -> Built:
        trainer = Trainer(GPT(config), train, FAKE_DEVICE)
        if compile_backend is not None:
            trainer.model = torch.compile(trainer.model, backend=compile_backend)
        shape = (batch_size, config.block_size)
        batch = torch.randint(0, config.vocab_size, shape)
        targets = torch.randint(0, config.vocab_size, shape)

        def step() -> None:
            trainer.train_step([(batch, targets)])

        return trainer.model, trainer.optimizer, step

    name = (
        f"ch. 3 language model, {batch_size} x {config.block_size}, {train.precision}"
    )
    if compile_backend is not None:
        name += f", compiled ({compile_backend})"
    return GpuStep(name, build, *formulas(config, batch_size, train.precision))


def formulas(
    config: GPTConfig, batch_size: int, precision: str, loop: str = "trainer"
) -> tuple[int, int]:
    """``predict_peak`` with the CPU's attention kernels and with CUDA's."""
    return tuple(
        predict_peak(
            config,
            TrainingShape(
                batch_size, config.block_size, precision, loop=loop, device_type=kind
            ),
        )
        for kind in ("cpu", "cuda")
    )


def lab_step(profile: Profile) -> GpuStep:
    """Chapter 9's step: one batch of the lab's epoch, the MLP in float32."""
    sizes = profile.lab

    def build() -> Built:
        model = MnistMLP(sizes.hidden)
        optimizer, scheduler = lab_optimizer("adamw", model, sizes, total_steps=2)
        images = torch.randn(sizes.batch_size, 1, 28, 28)
        labels = torch.randint(0, 10, (sizes.batch_size,))
        generator = torch.Generator().manual_seed(profile.seed)

        def step() -> None:
            train_epoch(
                model, optimizer, scheduler, images, labels, sizes.batch_size, generator
            )

        return model, optimizer, step

    peak = mlp_peak((28 * 28, *sizes.hidden, 10), sizes.batch_size)
    return GpuStep(f"ch. 8 lab MLP, batch {sizes.batch_size}", build, peak, peak)


def gpu_steps(profile: Profile, char_vocab_size: int) -> dict[str, GpuStep]:
    """The training steps of ``make gpu-results`` at ``profile``'s sizes, by run.

    ``char_vocab_size`` is the corpus's number of characters (chapter 3's
    vocabulary). Chapter 7's run is measured in bf16 and in float32, as the
    chapter runs it; the compile run compiles chapter 3's model.
    """
    lm, memory = profile.lm, profile.memory
    # chapter 3's model and loop, as charlm.build makes them
    lm_config = GPTConfig(
        char_vocab_size,
        lm.block_size,
        lm.n_layer,
        lm.n_head,
        lm.d_model,
        lm.dropout,
    )
    train = TrainConfig(
        max_steps=lm.max_steps,
        lr=lm.lr,
        min_lr=lm.min_lr,
        warmup_steps=lm.warmup_steps,
        precision=profile.precision,
        log_every=lm.log_every,
    )
    longest = GPTConfig(
        memory.vocab_size,
        max(memory.seq_lens),
        memory.n_layer,
        memory.n_head,
        memory.d_model,
    )
    return {
        "lm": trainer_step(lm_config, lm.batch_size, train),
        "compile": trainer_step(lm_config, lm.batch_size, train, "aot_eager"),
        "lab": lab_step(profile),
        "memory": gpt_step(longest, memory.batch_size, profile.precision),
        # chapter 7's largest float32 cell: the tutorial loop keeps the logits
        "memory-fp32": gpt_step(longest, memory.batch_size, "fp32", "tutorial"),
    }
