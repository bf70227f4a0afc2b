"""How much slower is the book's Trainer than a minimal hand-written loop?

Both train the same GPT on the same pre-generated token batches for the same
number of steps, in float32, with the same optimizer (``build_adamw``: AdamW,
two weight-decay groups, the fused kernel where the device has one) and gradient
clipping at 1.0, so what differs is the loop alone. Runs alternate in one
process (book, hand-written, hand-written, book, ...) so that load from other
processes hits both alike, and the median of the per-pair ratios is reported.
Runs are short (a fraction of a second) and pairs many, so a change in load
rarely falls between the two halves of a pair; process CPU time is printed
beside wall time as a second opinion, since it is less sensitive to other
processes on a shared machine.

What differs, on purpose:
- the Trainer counts target tokens and computes the loss as a token-weighted
  sum (so accumulation is exact), writes the schedule's learning rate into
  the optimizer, records a non-finite gradient norm on the device, and every
  ``log_every`` steps reads loss and gradient norm to the host and appends a
  history row;
- the hand-written loop uses ``cross_entropy``'s mean, a constant learning
  rate, and reads nothing back.

Run: ``.venv/bin/python bench/loop_overhead.py``. The last line is
``loop overhead ratio: <book time / hand-written time>``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

from torchbook.models import GPT, GPTConfig, TinyMLP
from torchbook.optim import build_adamw
from torchbook.train import TrainConfig, Trainer

# Large enough that one step takes tens of milliseconds on 2 CPU cores, so
# timer resolution and Python noise are small against it.
MODEL = GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, d_model=96)
BATCH_SIZE = 32
LR, WEIGHT_DECAY, BETAS, MAX_GRAD_NORM = 1e-3, 0.1, (0.9, 0.95), 1.0
LOG_EVERY = 10


def make_batches(steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (BATCH_SIZE, MODEL.block_size)
    return [
        (
            torch.randint(0, MODEL.vocab_size, shape, generator=generator),
            torch.randint(0, MODEL.vocab_size, shape, generator=generator),
        )
        for _ in range(steps)
    ]


def bench_config(steps: int) -> TrainConfig:
    return TrainConfig(
        max_steps=steps,
        lr=LR,
        min_lr=LR / 10,
        warmup_steps=0,
        weight_decay=WEIGHT_DECAY,
        betas=BETAS,
        max_grad_norm=MAX_GRAD_NORM,
        precision="fp32",
        log_every=LOG_EVERY,
    )


def run_book(model: GPT, batches, device: torch.device) -> tuple[float, float]:
    trainer = Trainer(model, bench_config(len(batches)), device)
    started, cpu_started = time.perf_counter(), time.process_time()
    for batch in batches:
        trainer.train_step([batch])
    trainer.log()
    return time.perf_counter() - started, time.process_time() - cpu_started


def run_hand_written(model: GPT, batches, device: torch.device) -> tuple[float, float]:
    # constant rate: no schedule
    optimizer = build_adamw(model, bench_config(len(batches)), device)
    started, cpu_started = time.perf_counter(), time.process_time()
    model.train()
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, time.process_time() - cpu_started


def fixed_cost_per_step(
    device: torch.device, steps: int = 300, repeats: int = 5
) -> tuple[float, float]:
    """Seconds per step of both loops on the tutorial TinyMLP.

    Compute is tiny there, so the bookkeeping shows. Best of ``repeats`` (the minimum
    is the least disturbed by other processes).
    """
    generator = torch.Generator().manual_seed(2)
    batches = [
        (
            torch.randn(32, 64, generator=generator),
            torch.randint(0, 10, (32,), generator=generator),
        )
        for _ in range(steps)
    ]
    book, hand = [], []
    for _ in range(repeats):
        torch.manual_seed(0)
        book.append(run_book(TinyMLP().to(device), batches, device)[0] / steps)
        torch.manual_seed(0)
        hand.append(run_hand_written(TinyMLP().to(device), batches, device)[0] / steps)
    return min(book), min(hand)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument(
        "--pairs", type=int, default=21, help="timed (book, hand-written) pairs"
    )
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)

    torch.manual_seed(0)
    initial = GPT(MODEL).to(device).state_dict()
    batches = make_batches(args.steps, seed=1)

    def fresh_model() -> GPT:
        model = GPT(MODEL).to(device)
        model.load_state_dict(copy.deepcopy(initial))
        return model

    # warm-up: allocator, kernels, first-call costs
    run_book(fresh_model(), batches[:5], device)
    run_hand_written(fresh_model(), batches[:5], device)

    book_times, hand_times, ratios, cpu_ratios = [], [], [], []
    for pair in range(args.pairs):
        # Alternate which goes first, so a drift in load does not favour one side.
        order = [("book", run_book), ("hand", run_hand_written)]
        if pair % 2:
            order.reverse()
        measured = {
            name: runner(fresh_model(), batches, device) for name, runner in order
        }
        (book_wall, book_cpu), (hand_wall, hand_cpu) = (
            measured["book"],
            measured["hand"],
        )
        book_times.append(book_wall)
        hand_times.append(hand_wall)
        ratios.append(book_wall / hand_wall)
        cpu_ratios.append(book_cpu / hand_cpu)
        print(
            f"pair {pair + 1:2d}: book {book_wall * 1e3 / args.steps:6.1f} ms/step, "
            f"hand-written {hand_wall * 1e3 / args.steps:6.1f} ms/step, "
            f"wall ratio {ratios[-1]:.3f}, cpu-time ratio {cpu_ratios[-1]:.3f}"
        )

    print(
        f"device {device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, "
        f"{args.steps} steps per run, {args.pairs} pairs"
    )
    print(
        f"median ms/step: book {statistics.median(book_times) * 1e3 / args.steps:.1f}, "
        f"hand-written {statistics.median(hand_times) * 1e3 / args.steps:.1f}"
    )
    print(f"median cpu-time ratio: {statistics.median(cpu_ratios):.3f}")
    book_fixed, hand_fixed = fixed_cost_per_step(device)
    print(
        f"fixed cost on TinyMLP: book {book_fixed * 1e6:.0f} us/step, "
        f"hand-written {hand_fixed * 1e6:.0f} us/step "
        f"(+{(book_fixed - hand_fixed) * 1e6:.0f} us of bookkeeping per step)"
    )
    print(f"loop overhead ratio: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
