"""Training speed of chat examples padded against packed with per-document masks.

Chapter 8 packs Tiny Shakespeare chat records (a speech, then the speech that
answers it) into rows with ``pack_documents`` and shows that each one's loss is
the same as alone. This bench times what packing buys: one forward and backward
pass of the book's GPT (the profile's language-model shape) over every
conversation, padded by ``PadCollate`` into batches of ``--batch-size``
conversations, and packed into batches of as many rows as long as the longest
conversation. It prints useful tokens per second (conversation tokens, not
positions, over the time) and the time per computed position, each the median
of ``--rounds`` alternated rounds, so a change in the machine's load reaches
both methods alike.

Packing saves positions, but attention's cost grows with the square of a row's
length: a padded batch of short conversations has short rows, a packed row is as
long as the longest conversation. So the bench also counts the attention scores
each layout puts in its ``(T, T)`` matrices per head and layer (the masked ones
included, since SDPA given a boolean mask is handed the whole matrix), beside the
positions.

Run: ``.venv/bin/python bench/packing_speed.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from torchbook.book.download import cache_dir, shakespeare_path
from torchbook.book.profiles import active_profile
from torchbook.chat import PadCollate, chat_example, pack_documents
from torchbook.device import synchronize
from torchbook.models import GPT, GPTConfig
from torchbook.tokenizer import PAD, cached_tokenizer


def conversations(records: int, vocab_size: int) -> tuple[list[dict], int]:
    """Chat examples (a speech, the next one as the answer) and the pad id."""
    text = shakespeare_path().read_text()
    tokenizer = cached_tokenizer(
        cache_dir() / "bench" / f"tokenizer-{vocab_size}.json",
        [shakespeare_path()],
        vocab_size,
    )
    speeches = [s.strip() for s in text.split("\n\n") if s.strip()]
    examples = []
    for i in range(records):
        messages = [
            {"role": "user", "content": speeches[i]},
            {"role": "assistant", "content": speeches[i + 1]},
        ]
        examples.append(
            chat_example(messages, lambda piece: tokenizer.encode(piece).ids)
        )
    return examples, tokenizer.token_to_id(PAD)


def padded_batches(examples: list[dict], batch_size: int, pad_id: int) -> list:
    """(tokens, targets, packing) per batch of conversations padded to the longest."""
    loader = DataLoader(examples, batch_size=batch_size, collate_fn=PadCollate(pad_id))
    return [(b["input_ids"][:, :-1], b["labels"][:, 1:], {}) for b in loader]


def packed_batches(examples: list[dict], batch_size: int, pad_id: int) -> list:
    """Per batch: (tokens, targets, packing) in rows as long as the longest example."""
    row_length = max(len(e["input_ids"]) for e in examples)
    rows = pack_documents(examples, row_length=row_length, pad_id=pad_id)
    batches = []
    for i in range(0, len(rows["tokens"]), batch_size):
        part = {name: rows[name][i : i + batch_size] for name in rows}
        packing = {k: part[k] for k in ("position_ids", "document_ids")}
        batches.append((part["tokens"], part["targets"], packing))
    return batches


def attention_scores(batches: list) -> int:
    """Entries of the (T, T) score matrices of every row, per head and layer."""
    return sum(tokens.size(0) * tokens.size(1) ** 2 for tokens, _, _ in batches)


def seconds_for_one_pass(model: GPT, batches: list, device: torch.device) -> float:
    """Forward and backward over every batch (gradients accumulate; no step)."""
    synchronize(device)
    started = time.perf_counter()
    for tokens, targets, packing in batches:
        packing = {name: t.to(device) for name, t in packing.items()}
        logits = model(tokens.to(device), **packing)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.to(device).flatten())
        loss.backward()
    synchronize(device)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    profile = active_profile()
    torch.manual_seed(profile.seed)

    examples, pad_id = conversations(args.records, args.vocab_size)
    methods = {
        "padded": padded_batches(examples, args.batch_size, pad_id),
        "packed": packed_batches(examples, args.batch_size, pad_id),
    }
    row_length = max(len(e["input_ids"]) for e in examples)
    model = GPT(
        GPTConfig(
            vocab_size=args.vocab_size,
            block_size=row_length,
            n_layer=profile.lm.n_layer,
            n_head=profile.lm.n_head,
            d_model=profile.lm.d_model,
        )
    ).to(profile.device)
    useful = sum(len(e["input_ids"]) for e in examples)
    machine = platform.processor() or platform.machine()
    print(
        f"machine: {machine}, {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"{args.threads} thread(s), device {profile.device}"
    )
    print(
        f"{len(examples)} conversations, {useful:,} tokens; GPT {profile.lm.n_layer} "
        f"layers x {profile.lm.d_model}; median of {args.rounds} alternated rounds"
    )
    for batches in methods.values():  # warm-up, untimed
        seconds_for_one_pass(model, batches[:1], profile.device)
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, batches in methods.items():
            seconds[name].append(seconds_for_one_pass(model, batches, profile.device))
    positions, scores = {}, {}
    for name, batches in methods.items():
        positions[name] = sum(tokens.numel() for tokens, _, _ in batches)
        scores[name] = attention_scores(batches)
        median = statistics.median(seconds[name])
        print(
            f"{name}: {positions[name]:>8,} positions, {scores[name]:>12,} attention "
            f"scores, {useful / median:>10,.0f} useful tokens/s, "
            f"{median / positions[name] * 1e6:.2f} us per position "
            f"(rounds {min(seconds[name]):.2f}-{max(seconds[name]):.2f} s)"
        )
    ratio = statistics.median(seconds["padded"]) / statistics.median(seconds["packed"])
    print(
        f"padded over packed: {positions['padded'] / positions['packed']:.2f}x the "
        f"positions, {scores['padded'] / scores['packed']:.2f}x the attention scores"
    )
    print(f"packed over padded, useful tokens per second: {ratio:.2f}x")


if __name__ == "__main__":
    main()
