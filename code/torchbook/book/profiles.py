"""Choose the device and the size of every run from the active book profile.

This is the only module that reads ``QUARTO_PROFILE``. Quarto sets it for the
kernel when you render with ``--profile``; it may be a comma-separated list
(``QUARTO_PROFILE=gpu,draft``). Tests set it the same way.

- ``cpu`` (the default): the CPU and small sizes, so a render on any machine
  gives the same numbers and every claim in the book still holds.
- ``gpu``: CUDA (or Apple's MPS), bf16 autocast and full sizes. It stops with a
  clear message when neither accelerator is present.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from torchbook.device import accelerator

PROFILE_VARIABLE = "QUARTO_PROFILE"
PROFILE_NAMES = ("cpu", "gpu")


class ProfileError(RuntimeError):
    """The requested profile cannot run on this machine."""


def size(cpu: Any, gpu: Any) -> Any:
    """A run size with its cpu value as the default and its gpu value beside it."""
    return field(default=cpu, metadata={"gpu": gpu})


def gpu_sizes(sizes: Any) -> Any:
    """``sizes`` with every field declared by ``size()`` set to its gpu value."""
    return replace(
        sizes,
        **{f.name: f.metadata["gpu"] for f in fields(sizes) if "gpu" in f.metadata},
    )


# Run sizes, one dataclass per chapter. A field declared with size(cpu=..., gpu=...)
# differs between the profiles; every other field is the same in both.


@dataclass(frozen=True)
class LanguageModelSizes:
    """Chapter 3: the small causal language model trained on Tiny Shakespeare.

    The cpu sizes train in float32 (the cpu profile's precision) in 12 to 15 s
    of CPU time on an AVX2 CPU without bf16 instructions, and still take the
    validation loss more than 1 nat/char below the unigram baseline (1.21 to
    1.26 over five seeds at 1 thread, the same at 2); the gpu sizes are the
    usual "baby GPT" for character-level Shakespeare.
    """

    block_size: int = size(cpu=64, gpu=256)  # characters of context
    n_layer: int = size(cpu=2, gpu=6)
    n_head: int = size(cpu=4, gpu=6)
    d_model: int = size(cpu=96, gpu=384)
    dropout: float = size(cpu=0.0, gpu=0.2)
    # blocks per optimizer step (accum_steps = 1)
    batch_size: int = size(cpu=16, gpu=64)
    max_steps: int = size(cpu=300, gpu=5000)
    # a small model tolerates a large peak learning rate
    lr: float = size(cpu=3e-3, gpu=0.001)
    min_lr: float = size(cpu=3e-4, gpu=0.0001)
    warmup_steps: int = size(cpu=30, gpu=100)
    eval_every: int = size(cpu=100, gpu=250)
    eval_batches: int = size(cpu=16, gpu=50)  # validation batches per evaluation
    log_every: int = size(cpu=10, gpu=50)
    sample_tokens: int = size(cpu=300, gpu=500)  # characters generated after training
    plain_steps: int = 100  # steps of the chapter's plain loop (constant learning rate)
    clip_demo_steps: int = 40  # steps of each run of the clipping demonstration
    # the bf16-loss demonstration's vocabulary: GPT-2's, rounded up to a multiple of
    # 64, as chapter 7's gpu runs use it (an LLM's vocabulary, not the characters')
    loss_vocab_size: int = 50_304


@dataclass(frozen=True)
class DataSizes:
    """Chapter 4: token shards, streaming and DataLoader measurements."""

    # byte-level BPE trained on Tiny Shakespeare
    vocab_size: int = size(cpu=2048, gpu=8192)
    tokens_per_shard: int = 100_000  # small, so Tiny Shakespeare makes several shards
    block_size: int = size(cpu=256, gpu=1024)
    batch_size: int = size(cpu=32, gpu=64)
    num_workers: int = size(cpu=2, gpu=4)
    # batches timed per streaming measurement
    timed_batches: int = size(cpu=200, gpu=1000)
    # the tutorial TokenDataset is slow; fewer batches give a stable rate
    tutorial_timed_batches: int = size(cpu=30, gpu=100)
    chat_records: int = 200  # local chat records built from Tiny Shakespeare
    chat_batch_size: int = 8


@dataclass(frozen=True)
class CheckpointSizes:
    """Chapter 5: checkpointing and exact resume.

    The kill-and-resume run always trains on the CPU with one thread (that is
    where bit-exact resume is proven); the gpu profile makes it longer and the
    model used for the loading demonstrations bigger.
    """

    # The small GPT trained by examples/resume_demo.py, byte-level.
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    dropout: float = 0.1  # > 0 so that exact resume needs the RNG state
    batch_size: int = 8
    accum_steps: int = 2
    steps: int = size(cpu=24, gpu=60)  # optimizer steps of the whole run
    save_every: int = size(cpu=6, gpu=10)  # a checkpoint every this many steps
    # the run is SIGKILLed once this checkpoint is durable
    kill_after_checkpoint: int = size(cpu=2, gpu=3)
    keep_last: int = 2  # checkpoints kept on disk
    # The model used to show safetensors, sharding, meta-device loading and mmap.
    demo_n_layer: int = size(cpu=4, gpu=12)
    demo_d_model: int = size(cpu=256, gpu=768)
    demo_n_head: int = size(cpu=4, gpu=12)
    demo_vocab_size: int = size(cpu=4096, gpu=50304)
    demo_block_size: int = size(cpu=256, gpu=1024)
    # largest safetensors shard in the sharding demonstration
    shard_bytes: int = size(cpu=2_000_000, gpu=100_000_000)


@dataclass(frozen=True)
class PitfallSizes:
    """Chapter 11: the pitfalls and self-check demonstrations.

    Each demonstration shows a behaviour, not a speed, so both profiles use the
    same tiny sizes; only the device changes.
    """

    features: int = 16  # width of the small demonstration models
    batch_size: int = 8
    n_layer: int = 2  # hidden layers of the list-of-layers model
    dropout: float = 0.1  # the GPT's dropout in the train/eval demonstration
    vocab_size: int = 256  # byte-level vocabulary of that GPT
    clip_steps: int = 30  # SGD steps of the clipping demonstration
    spike_step: int = 10  # the step whose batch carries the outlier
    spike_scale: float = 30.0  # the outlier batch's inputs are this many times larger
    clip_lr: float = (
        0.05  # high for this problem: one outlier step throws the weights far
    )
    max_grad_norm: float = (
        20.0  # above every ordinary step's norm, far below the outlier's
    )
    curve_steps: int = 60  # optimizer steps of each pitfall's training curve
    # The zero_grad curve: SGD converges at this rate only with gradients cleared.
    sgd_lr: float = 0.02
    adam_lr: float = 0.05  # AdamW in the train/eval-mode and stale-state curves
    # The starved loader: each image waits this long, as if decoded from a JPEG.
    slow_item_s: float = 0.002
    loader_batch_size: int = 32
    loader_steps: int = 20  # timed steps for each num_workers
    loader_workers: int = 2


@dataclass(frozen=True)
class LabSizes:
    """Chapter 10: the lab's MLP on MNIST, its seven drills and its loader measurements.

    MNIST is small enough that both profiles train the same model the same
    number of epochs; the cpu profile only times fewer steps and trains the
    bf16 comparison shorter.
    """

    hidden: tuple[int, ...] = (256, 128)  # the 784-256-128-10 MLP
    batch_size: int = 128
    epochs: int = 3  # the drill's limit
    lr: float = 2e-3  # AdamW's peak rate, cosine-decayed to min_lr over the run
    min_lr: float = 0.0
    weight_decay: float = 0.01
    sgd_lr: float = 0.05  # SGD with momentum 0.9 (drill 3)
    target_accuracy: float = 0.97
    micro_batch_size: int = 32  # drill 4: accum_steps micro-batches of this size
    accum_steps: int = 4
    equivalence_steps: int = 20  # drill 4: optimizer steps compared update by update
    # drill 3: the loss curves' moving mean, in optimizer steps
    smoothing_steps: int = 50
    # drill 2: steps timed per model after the first, eager and compiled in turn
    compile_timed_steps: int = size(cpu=100, gpu=400)
    # drill 5: steps of the two runs trained in fp32 and under bf16 autocast; short
    # on the cpu profile, where a CPU without native bf16 runs them ten times slower
    autocast_train_steps: int = size(cpu=150, gpu=1407)
    # batches timed per DataLoader measurement
    loader_batches: int = size(cpu=30, gpu=50)


@dataclass(frozen=True)
class DeviceSizes:
    """Chapter 6: devices, two-process DDP and FSDP2, torch.compile, one-device tools.

    The distributed runs prove equalities, not speed, so both profiles use a
    tiny GPT for them; the compile and matmul measurements grow on the gpu profile.
    """

    # The GPT of the DDP / FSDP2 runs (byte-level, so the vocabulary is 256).
    vocab_size: int = 256
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 32
    world_size: int = 2  # processes torchrun starts
    micro_batch_size: int = 4  # rows per rank per micro-batch
    accum_steps: int = 2
    ddp_steps: int = 12  # steps of the TokenStream DDP run
    check_steps: int = 4  # AdamW steps compared between DDP, one process and FSDP2
    lr: float = 3e-3
    launch_timeout_s: float = 240.0  # a torchrun job that takes longer is killed
    minimal_text_bytes: int = (
        300_000  # the start of Tiny Shakespeare that examples/ddp_minimal.py trains on
    )
    # torch.compile: a small GPT, timed step by step, eager against compiled.
    compile_n_layer: int = size(cpu=1, gpu=6)
    compile_d_model: int = size(cpu=64, gpu=384)
    compile_block_size: int = size(cpu=64, gpu=256)
    compile_batch_size: int = size(cpu=8, gpu=32)
    timed_steps: int = size(cpu=20, gpu=50)
    # the square matmul of the TF32 comparison
    matmul_size: int = size(cpu=512, gpu=8192)


@dataclass(frozen=True)
class MemorySizes:
    """Chapter 7: the GPT whose memory and FLOPs are predicted and measured.

    The cpu sizes keep each measured step under a second on one thread; the gpu
    sizes are GPT-2 small (124M parameters) at GPT-2's vocabulary and contexts.
    """

    vocab_size: int = size(cpu=256, gpu=50304)
    n_layer: int = size(cpu=2, gpu=12)
    n_head: int = size(cpu=4, gpu=12)
    d_model: int = size(cpu=128, gpu=768)
    batch_size: int = size(cpu=4, gpu=8)  # rows per step
    # contexts compared
    seq_lens: tuple[int, ...] = size(
        cpu=(64, 128, 256, 512), gpu=(256, 512, 1024, 2048)
    )
    timed_steps: int = size(cpu=3, gpu=20)  # training steps timed for tokens per second
    # square matmul whose measured rate is the peak for MFU
    matmul_size: int = size(cpu=1024, gpu=8192)


@dataclass(frozen=True)
class PretrainedSizes:
    """Chapter 8: the stand-in checkpoint and the LoRA fine-tune of it."""

    # The stand-in Llama: grouped-query attention, an untied head, as most Llamas.
    d_model: int = size(cpu=64, gpu=512)
    n_layer: int = size(cpu=2, gpu=8)
    n_head: int = size(cpu=4, gpu=8)
    n_kv_head: int = size(cpu=2, gpu=2)
    mlp_size: int = size(cpu=176, gpu=1376)  # about 8/3 d_model, as in Llama
    max_positions: int = size(cpu=128, gpu=512)  # its context, trained in full
    tie_embeddings: bool = False
    # Its pretraining on Tiny Shakespeare: a few seconds on the cpu profile.
    batch_size: int = size(cpu=8, gpu=32)  # rows of max_positions + 1 tokens
    steps: int = size(cpu=120, gpu=2000)
    lr: float = size(cpu=3e-3, gpu=1e-3)
    # largest shard save_pretrained writes: several shards, as on the hub
    max_shard_bytes: int = size(cpu=300_000, gpu=20_000_000)
    # The LoRA fine-tune on chat records that fit the context.
    lora_rank: int = size(cpu=8, gpu=16)
    lora_alpha: float = size(cpu=16.0, gpu=32.0)
    finetune_records: int = size(cpu=600, gpu=5000)
    heldout_records: int = size(cpu=100, gpu=500)
    finetune_rows: int = size(cpu=8, gpu=16)  # packed rows per step
    finetune_steps: int = size(cpu=60, gpu=600)
    finetune_lr: float = size(cpu=3e-3, gpu=1e-3)


@dataclass(frozen=True)
class FineTuneSizes:
    """Chapter 9: the question task, the LoRA fine-tunes on it and their settings.

    The cpu fine-tune (120 AdamW steps of 4 packed rows of 64 tokens, the rate
    held at 1e-2 for two thirds of the run, then decayed linearly to 0) takes
    about 2.5 s of CPU time, and answered 97.5% to 100% of the held-out lines
    with the stand-in and the fine-tune of eight seeds (1337, 1 to 7). The gpu
    sizes have not been run.
    """

    # chats per answer (yes, no); the held-out tenth of the text has 201 questions
    train_per_answer: int = size(cpu=1000, gpu=1500)
    held_out_per_answer: int = size(cpu=100, gpu=200)
    row_length: int = size(cpu=64, gpu=256)  # tokens per packed row
    rows_per_step: int = size(cpu=4, gpu=16)
    steps: int = size(cpu=120, gpu=400)
    lr: float = size(cpu=1e-2, gpu=2e-3)  # AdamW's peak: held, then decayed to 0
    lora_rank: int = 8
    lora_alpha: float = 16.0


@dataclass(frozen=True)
class Profile:
    """Device and run sizes for one profile.

    Chapters read these; none hard-codes its own.
    """

    name: str
    device: torch.device
    precision: str  # a key of AUTOCAST_DTYPES
    lm: LanguageModelSizes = LanguageModelSizes()
    data: DataSizes = DataSizes()
    checkpoint: CheckpointSizes = CheckpointSizes()
    pitfalls: PitfallSizes = PitfallSizes()
    lab: LabSizes = LabSizes()
    devices: DeviceSizes = DeviceSizes()
    memory: MemorySizes = MemorySizes()
    pretrained: PretrainedSizes = PretrainedSizes()
    finetune: FineTuneSizes = FineTuneSizes()
    seed: int = 1337


def parse_profile(value: str | None) -> str:
    """Return ``"cpu"`` or ``"gpu"`` from a ``QUARTO_PROFILE`` value.

    Names other than ``cpu`` and ``gpu`` belong to other Quarto profiles and are
    ignored; asking for both at once is an error rather than a silent choice.
    """
    names = [part.strip() for part in (value or "").split(",") if part.strip()]
    chosen = [name for name in names if name in PROFILE_NAMES]
    if len(set(chosen)) > 1:
        raise ProfileError(
            f"{PROFILE_VARIABLE}={value!r} names both 'cpu' and 'gpu'; choose one."
        )
    return chosen[0] if chosen else "cpu"


def gpu_profile(device: torch.device) -> Profile:
    """The gpu profile's sizes and precision on ``device``.

    ``make_profile("gpu")`` passes this machine's accelerator; the dry run of
    the GPU results (``make gpu-results DRY_RUN=1``) passes the CPU, to run the
    full sizes everywhere up to the device.
    """
    cpu = make_profile("cpu")
    return Profile(
        name="gpu",
        device=device,
        precision="bf16",
        lm=gpu_sizes(cpu.lm),
        data=gpu_sizes(cpu.data),
        checkpoint=gpu_sizes(cpu.checkpoint),
        pitfalls=gpu_sizes(cpu.pitfalls),
        lab=gpu_sizes(cpu.lab),
        devices=gpu_sizes(cpu.devices),
        memory=gpu_sizes(cpu.memory),
        pretrained=gpu_sizes(cpu.pretrained),
        finetune=gpu_sizes(cpu.finetune),
    )


def make_profile(name: str) -> Profile:
    """Build the profile called ``name`` for this machine."""
    if name == "cpu":
        return Profile(name="cpu", device=torch.device("cpu"), precision="fp32")
    if name == "gpu":
        device = accelerator()
        if device is None:
            raise ProfileError(
                "The gpu profile needs CUDA or MPS, and this machine has neither. "
                "Render with the default cpu profile instead (quarto render), "
                "which reuses or recomputes the small CPU results."
            )
        return gpu_profile(device)
    raise ProfileError(f"unknown profile {name!r}; expected one of {PROFILE_NAMES}")


def active_profile() -> Profile:
    """The profile named by ``QUARTO_PROFILE`` (``cpu`` when it is unset)."""
    return make_profile(parse_profile(os.environ.get(PROFILE_VARIABLE)))
