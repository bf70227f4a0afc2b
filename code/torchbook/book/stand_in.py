"""A stand-in "pretrained" checkpoint, made by transformers, for a build with no hub.

Chapter 8 starts, as fine-tuning does, from someone else's checkpoint: a folder
of config.json, sharded safetensors and a tokenizer. The book's build cannot
download one, so ``make_stand_in`` makes it the way its authors would: a small
``transformers.LlamaForCausalLM`` trained briefly on Tiny Shakespeare with the
book's BPE tokenizer, then ``save_pretrained(max_shard_size=...)``, which
writes shards and their index as hub checkpoints have them, and the tokenizer
beside them. Everything in the folder comes from transformers, not from the
book's Llama, so loading it into the book's module is a real check.

Its sizes are ``torchbook.book.profiles.PretrainedSizes`` (``profile.pretrained``).

It builds on ``torchbook.hf`` (the tokenizer as transformers takes it) and
``torchbook.tokenizer``, and ``torchbook.book.profiles`` for its sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer

from torchbook.book.profiles import PretrainedSizes
from torchbook.device import autocast
from torchbook.hf import hf_tokenizer
from torchbook.tokenizer import END_OF_TEXT, PAD


@dataclass(frozen=True)
class StandIn:
    """The folder ``make_stand_in`` wrote and the training losses it logged."""

    folder: Path
    losses: list[float]


def make_stand_in(
    folder: str | Path,
    tokenizer: Tokenizer,
    text: str,
    sizes: PretrainedSizes,
    device: torch.device,
    precision: str = "fp32",
    seed: int = 0,
) -> StandIn:
    """Train a small ``LlamaForCausalLM`` on ``text`` and save it with its tokenizer.

    Rows of ``max_positions`` tokens start at random offsets (drawn from a
    generator seeded with ``seed``); AdamW at a constant ``lr``; the loss is
    computed in float32 from the logits, as the book's training loop does.
    """
    wrapped = hf_tokenizer(tokenizer)
    ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)
    if ids.numel() <= sizes.max_positions:
        raise ValueError(
            f"make_stand_in: the text has {ids.numel()} tokens, fewer than one row "
            f"of max_positions={sizes.max_positions} + 1"
        )
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=sizes.d_model,
        intermediate_size=sizes.mlp_size,
        num_hidden_layers=sizes.n_layer,
        num_attention_heads=sizes.n_head,
        num_key_value_heads=sizes.n_kv_head,
        max_position_embeddings=sizes.max_positions,
        tie_word_embeddings=sizes.tie_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.token_to_id(END_OF_TEXT),
        pad_token_id=tokenizer.token_to_id(PAD),
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=sizes.lr)
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(sizes.max_positions + 1)
    losses = []
    for _ in range(sizes.steps):
        starts = torch.randint(
            ids.numel() - sizes.max_positions,
            (sizes.batch_size, 1),
            generator=generator,
        )
        rows = ids[starts + offsets].to(device)  # (batch, max_positions + 1)
        with autocast(device.type, precision):
            logits = model(input_ids=rows[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    folder = Path(folder)
    model.save_pretrained(folder, max_shard_size=sizes.max_shard_bytes)
    wrapped.save_pretrained(folder)
    return StandIn(folder, losses)
