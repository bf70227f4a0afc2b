"""The memory models of torchbook against measurements, small and at full size.

The book's GPT (``torchbook.memory.gpt``): for each configuration (model, batch,
sequence length, precision, checkpointing none / selective / full, dropout,
chunked loss, and the loop: the book's ``Trainer.train_step`` itself, or the
tutorial loop that keeps the logits) it predicts the saved-activation bytes
and the peak of a training step, and measures both without the formula: the
``saved_tensors_hooks`` count and the allocator's peak (the profiler's records
on the CPU, ``torch.cuda.max_memory_allocated`` on CUDA) plus the exact bytes
of the parameters and the optimizer's states. Then the KV cache's bytes, and
DDP's gradient buckets on two CPU ranks (gloo), with and without
``gradient_as_bucket_view``.

The models readers fine-tune (``torchbook.memory.peak``), at their real sizes
(124M to 8B parameters, the public configs of ``tests/test_memory_configs.py``):
one step of transformers' own model, of peft's LoRA model and of FSDP2 over a
fake process group of 8 ranks, on fake tensors (``torchbook.memory.check``,
the CPU's kernels), against the prediction. Each check's seconds are printed,
wall and CPU (the CPU time is what another process's load does not inflate).
Last, QLoRA: a Llama that transformers loads in 4 bits (bitsandbytes' NF4)
with peft's adapters, one real step on the CPU measured by the allocator
(``torchbook.memory.qlora_step``), against the prediction with ``base="nf4"``.

Run: ``.venv/bin/python bench/memory_model.py`` (``--device cuda`` on a GPU for
the first part; the fake runs stay on the CPU). The last line printed is
``largest memory prediction error: <x>%``, and the script exits with an error
when it is above ``MAX_ERROR``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from torchbook.memory import TrainingSetup
from torchbook.memory.check import fake_peak
from torchbook.memory.configs import architecture
from torchbook.memory.gpt import kv_cache_bytes, predict_memory, predict_peak
from torchbook.memory.measure import (
    ddp_bucket_bytes,
    peak_bytes,
    saved_activation_bytes,
    state_bytes,
    training_loss,
    training_step,
)
from torchbook.memory.peak import predict
from torchbook.memory.qlora_step import measured_peak
from torchbook.models import GPT, GPTConfig
from torchbook.recompute import checkpoint_blocks_selectively
from torchbook.train import TrainConfig, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' configs
from tests.test_memory_configs import REAL_CONFIGS  # noqa: E402

MAX_ERROR = 0.05  # the bound on every prediction
VOCAB_SIZE = 256  # byte-level, as the book's small GPTs
MODELS = ((2, 4, 64), (4, 4, 128))  # (n_layer, n_head, d_model)
SHAPES = ((8, 128), (2, 512))  # (batch, sequence length)
DDP_CONFIG = GPTConfig(VOCAB_SIZE, 64, 2, 4, 64)
STEP = TrainingSetup(batch_size=1, seq_len=2048, precision="bf16", kernels="cpu")
# (public config, setup): each family, then LoRA as peft makes it, then FSDP2
FULL_SIZE = [
    ("Llama-3.2-1B", STEP),
    ("Llama-3-8B", STEP),
    ("Mistral-7B-v0.1", STEP),
    ("Qwen2.5-0.5B", STEP),
    ("Qwen2.5-7B", STEP),
    ("gpt2", replace(STEP, batch_size=8, seq_len=1024)),
    ("gpt2-xl", replace(STEP, seq_len=1024)),
    ("Llama-3-8B", replace(STEP, trains="lora")),
    (
        "Llama-3.2-1B",
        replace(
            STEP,
            batch_size=4,
            trains="lora",
            lora_rank=16,
            lora_targets=("all-linear",),
            precision="bf16-pure",
            checkpointing="full",
        ),
    ),
    ("Llama-3-8B", replace(STEP, parallel="fsdp", ranks=8, precision="bf16-master")),
    ("Llama-3-8B", replace(STEP, parallel="fsdp", ranks=8)),
    (
        "Qwen2.5-7B",
        replace(
            STEP,
            batch_size=2,
            seq_len=4096,
            parallel="fsdp",
            ranks=8,
            precision="bf16-master",
            checkpointing="full",
        ),
    ),
]


def build(config: GPTConfig, shape: TrainingSetup, device: torch.device) -> GPT:
    torch.manual_seed(0)
    model = GPT(config).to(device).train()
    if shape.checkpointing == "selective":
        checkpoint_blocks_selectively(model)
    return model


def measure(
    config: GPTConfig, shape: TrainingSetup, device: torch.device
) -> tuple[int, int]:
    """Measured saved-activation bytes and peak bytes of one steady training step."""
    model = build(config, shape, device)
    idx = torch.randint(
        0, config.vocab_size, (shape.batch_size, shape.seq_len), device=device
    )
    targets = idx.roll(-1, dims=1)
    if shape.loop == "trainer":  # the book's Trainer, as a reader runs it
        train = TrainConfig(precision=shape.precision, loss_chunks=shape.loss_chunks)
        trainer = Trainer(model, train, device)
        optimizer = trainer.optimizer

        def step() -> None:
            trainer.train_step([(idx, targets)])

    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

        def step() -> None:
            training_step(model, optimizer, idx, targets, shape.precision, "tutorial")

    step()  # the optimizer creates its states in the first step
    saved = saved_activation_bytes(
        model,
        lambda: training_loss(model, idx, targets, shape.precision, shape.loss_chunks),
    )
    states = state_bytes(model, optimizer)
    return saved, states["parameters"] + states["optimizer_states"] + peak_bytes(
        step, device
    )


def shapes(kernels: str) -> list[tuple[GPTConfig, TrainingSetup]]:
    """The grid: every model and shape in both precisions, with each lever."""
    levers = [  # (checkpointing, dropout, loss_chunks, loop)
        ("none", 0.0, 1, "trainer"),
        ("none", 0.1, 1, "trainer"),
        ("none", 0.0, 1, "tutorial"),
        ("none", 0.0, 4, "trainer"),
        ("selective", 0.0, 1, "trainer"),
        ("full", 0.0, 1, "trainer"),
        ("full", 0.1, 4, "trainer"),
    ]
    grid = []
    for (layers, heads, width), (batch, steps), precision, lever in itertools.product(
        MODELS, SHAPES, ("fp32", "bf16"), levers
    ):
        checkpointing, dropout, chunks, loop = lever
        config = GPTConfig(
            VOCAB_SIZE,
            steps,
            layers,
            heads,
            width,
            dropout,
            activation_checkpointing=checkpointing == "full",
        )
        shape = TrainingSetup(
            batch,
            steps,
            precision,
            checkpointing=checkpointing,
            loss_chunks=chunks,
            loop=loop,
            kernels=kernels,
        )
        grid.append((config, shape))
    return grid


def kv_cache_error(device: torch.device) -> float:
    """Bytes a cached generation allocates for keys and values, against the formula."""
    config = GPTConfig(VOCAB_SIZE, 512, 4, 4, 128)
    torch.manual_seed(0)
    model = GPT(config).to(device).eval()
    prompt = torch.randint(0, VOCAB_SIZE, (2, 8), device=device)
    with torch.inference_mode():
        logits_bytes = peak_bytes(lambda: model(prompt), device)
        measured = peak_bytes(lambda: model.generate(prompt, 1, use_cache=True), device)
    predicted = kv_cache_bytes(config, 2, config.block_size, 4)
    # the cache is allocated whole; the prompt's forward comes on top of it
    error = predicted / (measured - logits_bytes) - 1
    print(
        f"KV cache: predicted {predicted:,} B, measured {measured - logits_bytes:,} B"
    )
    return error


def ddp_errors() -> list[float]:
    """DDP's buckets and gradients on two CPU ranks, with and without bucket views."""
    errors = []
    torch.manual_seed(0)
    measured = ddp_bucket_bytes(GPT(DDP_CONFIG))
    for bucket_view, (built, backward) in measured.items():
        shape = TrainingSetup(
            2, 64, parallel="ddp", ranks=2, gradient_as_bucket_view=bucket_view
        )
        memory = predict_memory(DDP_CONFIG, shape)
        print(
            f"DDP gradient_as_bucket_view={bucket_view}: buckets predicted "
            f"{memory.gradient_buckets:,} B, measured {built:,} B; gradients "
            f"predicted {memory.gradients:,} B, measured {backward:,} B"
        )
        errors.append(memory.gradient_buckets / built - 1)
        if memory.gradients:
            errors.append(memory.gradients / backward - 1)
        else:  # bucket views: a backward adds no gradient memory
            errors.append(backward / memory.gradient_buckets)
    return errors


def full_size_errors() -> list[float]:
    """One fake-tensor step of each model at its real size, against the prediction."""
    print(
        f"\n{'model':16s}{'setup':>44s} | {'peak GB pred / fake':>20s}{'err':>7s}"
        f" | {'s wall / CPU':>13s}"
    )
    errors = []
    for name, setup in FULL_SIZE:
        arch = architecture(REAL_CONFIGS[name], name)
        start, cpu = time.perf_counter(), time.process_time()
        measured = fake_peak(arch, setup)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        predicted = predict(arch, setup).peak
        errors.append(abs(predicted / measured - 1))
        described = [f"{setup.batch_size}x{setup.seq_len}", setup.precision]
        described += [setup.trains] if setup.trains != "all" else []
        described += [setup.checkpointing] if setup.checkpointing != "none" else []
        described += [f"fsdp/{setup.ranks}"] if setup.parallel == "fsdp" else []
        print(
            f"{name:16s}{' '.join(described):>44s} | {predicted / 1e9:>9.2f} / "
            f"{measured / 1e9:>8.2f}{predicted / measured - 1:>+7.1%} | "
            f"{wall:>5.1f} / {cpu:>5.1f}",
            flush=True,
        )
    return errors


QLORA_LLAMA = {  # a Llama small enough to quantize and step on the CPU in seconds
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}
QLORA = TrainingSetup(
    2, 512, precision="bf16", trains="lora", base="nf4", kernels="cpu"
)


def qlora_errors() -> list[float]:
    """Measured QLoRA steps on the CPU (real tensors), against the prediction."""
    print(
        f"\n{'QLoRA step (4-bit base)':48s} | {'peak MB pred / meas':>24s}{'err':>7s}"
    )
    errors = []
    arch = architecture(QLORA_LLAMA, "a 4-layer Llama of width 512")
    for setup in (
        QLORA,
        replace(QLORA, precision="bf16-pure", lora_targets=("all-linear",)),
    ):
        measured = measured_peak(arch, setup)
        predicted = predict(arch, setup).peak
        errors.append(abs(predicted / measured - 1))
        targets = ",".join(setup.lora_targets) or "peft's targets"
        name = f"{setup.batch_size}x{setup.seq_len} {setup.precision} {targets}"
        print(
            f"{name:48s} | {predicted / 1e6:>11.2f} / {measured / 1e6:>10.2f}"
            f"{predicted / measured - 1:>+7.1%}",
            flush=True,
        )
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    print(
        f"{'layers':>6s}{'width':>6s}{'batch':>6s}{'tokens':>7s}{'prec':>5s}"
        f"{'ckpt':>10s}{'drop':>5s}{'chunks':>7s}{'loop':>9s}"
        f" | {'saved MB pred / meas':>20s}{'err':>7s} | {'peak MB pred / meas':>19s}"
        f"{'err':>7s}"
    )
    errors = []
    for config, shape in shapes(device.type):
        saved, peak = measure(config, shape, device)
        predicted_saved = predict_memory(config, shape).activations
        predicted_peak = predict_peak(config, shape)
        saved_error, peak_error = predicted_saved / saved - 1, predicted_peak / peak - 1
        errors += [abs(saved_error), abs(peak_error)]
        print(
            f"{config.n_layer:>6d}{config.d_model:>6d}{shape.batch_size:>6d}"
            f"{shape.seq_len:>7d}{shape.precision:>5s}{shape.checkpointing:>10s}"
            f"{config.dropout:>5.1f}{shape.loss_chunks:>7d}{shape.loop:>9s}"
            f" | {predicted_saved / 1e6:>9.2f} / {saved / 1e6:>8.2f}"
            f"{saved_error:>+7.1%}"
            f" | {predicted_peak / 1e6:>8.2f} / {peak / 1e6:>8.2f}{peak_error:>+7.1%}",
            flush=True,
        )
    errors.append(abs(kv_cache_error(device)))
    if device.type == "cpu":
        errors += [abs(error) for error in ddp_errors()]
    errors += full_size_errors()
    errors += qlora_errors()
    worst = max(errors)
    print(f"largest memory prediction error: {worst:.1%}")
    return 0 if worst <= MAX_ERROR else 1


if __name__ == "__main__":
    sys.exit(main())
