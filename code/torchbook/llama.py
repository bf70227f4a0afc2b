"""A Llama-family language model, written to be read top to bottom like the book's GPT.

Llama and the many checkpoints that share its architecture (TinyLlama, SmolLM,
Llama 3.2, ...) are the book's GPT with four parts changed:

    token embedding
    -> n_layer x [RMSNorm -> grouped-query attention (RoPE, SDPA) -> + residual,
                  RMSNorm -> SwiGLU MLP                           -> + residual]
    -> final RMSNorm -> output head (tied to the embedding, or its own) -> logits

- **RMSNorm** instead of LayerNorm: divide by the root mean square and scale; no
  mean subtracted, no bias (Zhang and Sennrich 2019).
- **SwiGLU** instead of the GELU MLP: ``down(silu(gate(x)) * up(x))``, a gated
  MLP (Shazeer 2020); three matrices of width ``mlp_size`` instead of two.
- **RoPE with the checkpoint's base** (``rope_theta``) and, for Llama 3.1 and
  later, its rescaled frequencies. The tables and the rotation are the GPT's
  (the rotate-half layout Hugging Face checkpoints use), from
  ``torchbook.decoder``, but made at each call for the positions it reaches
  instead of stored: for Llama 3.1's 131,072 positions and heads of 128
  features, stored float32 tables would take 134 MB.
- **Grouped-query attention**: ``n_head`` query heads share ``n_kv_head`` key
  and value heads (Ainslie et al. 2023), so the KV cache, which stores only
  those, is ``n_head / n_kv_head`` times smaller.

No linear layer has a bias. The names are the book's (``blocks.0.attn.query``);
``torchbook.hf_checkpoint`` maps them to Hugging Face's. ``generate`` decodes
greedily, or samples with temperature, top-k and top-p from a seeded generator.

It builds on ``torchbook.decoder`` for RoPE's tables and rotation, the packed
rows' mask, the token-id check and the initialisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchbook.decoder import (
    apply_rope,
    check_token_ids,
    document_causal_mask,
    init_weights,
    rope_tables,
)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE rescaling (``"rope_type": "llama3"`` in config.json).

    Feature pairs whose rotation takes more than ``original_max_positions /
    low_freq_factor`` positions per turn are slowed by ``factor``, those taking
    fewer than ``original_max_positions / high_freq_factor`` are kept, and those
    between are interpolated: the slow rotations, which set how far apart two
    positions look, then stay within the angles the model was trained on over a
    context ``factor`` times longer.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


@dataclass
class LlamaConfig:
    """Shape of a Llama. The defaults are those of Hugging Face's ``LlamaConfig``.

    The special tokens' ids change nothing the model computes; they travel with
    it so that a folder saved back names the same tokens as the one loaded.
    """

    vocab_size: int
    n_layer: int
    n_head: int  # query heads
    n_kv_head: int  # key/value heads: n_head for full attention, fewer for GQA
    d_model: int
    mlp_size: int  # SwiGLU's hidden width ("intermediate_size")
    head_size: int | None = None  # None: d_model // n_head
    max_positions: int = 2048  # longest context the model was trained for
    rope_theta: float = 10_000.0  # RoPE's base
    rope_scaling: Llama3RopeScaling | None = None
    norm_eps: float = 1e-6
    tie_embeddings: bool = False  # the head reuses the embedding matrix
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2  # Llama 3.1's chat models list three
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"LlamaConfig.{name} must be a positive int, got {value!r}"
                )
        if self.head_size is None:
            self.head_size = self.d_model // self.n_head
        if not isinstance(self.head_size, int) or self.head_size < 1:
            raise ValueError(
                f"LlamaConfig.head_size must be a positive int, got "
                f"{self.head_size!r} (d_model={self.d_model}, n_head={self.n_head})"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"LlamaConfig: n_head={self.n_head} must be a multiple of "
                f"n_kv_head={self.n_kv_head} (each key/value head serves a group)"
            )
        if self.head_size % 2:
            raise ValueError(
                f"LlamaConfig: head_size={self.head_size} must be even, "
                "because RoPE rotates pairs of features"
            )


def rope_frequencies(config: LlamaConfig, device: torch.device) -> torch.Tensor:
    """Radians per position of each feature pair: ``rope_theta ** (-2i / head_size)``.

    Written as Hugging Face writes it (``1 / base ** (2i / d)``), so both round
    alike; with ``rope_scaling``, rescaled as ``Llama3RopeScaling`` says.
    """
    pairs = torch.arange(0, config.head_size, 2, device=device).float()
    inv_freq = 1.0 / (config.rope_theta ** (pairs / config.head_size))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    wavelength = 2 * math.pi / inv_freq  # positions per full turn
    # 0 for the slow rotations (divided by factor), 1 for the fast ones (kept)
    smooth = (scaling.original_max_positions / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smooth = smooth.clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * weight``: LayerNorm without mean and bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 whatever x's dtype: a mean of squares in bf16 loses digits.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


@dataclass(frozen=True)
class Mask:
    """What SDPA is told about which keys a query sees.

    ``causal`` (SDPA's ``is_causal``: query t sees keys 0..t), or ``tensor``, a
    boolean mask (True where a query may attend), or neither: every key. As in
    transformers, a mask tensor is built only where the other two cannot say
    it (packed rows, several tokens after a cache): on CUDA each of SDPA's
    fused kernels takes only some inputs (PyTorch's documentation of
    ``scaled_dot_product_attention`` lists them), and which kernel a mask
    beside ``enable_gqa`` leaves there, the book has not measured.
    """

    causal: bool = False
    tensor: torch.Tensor | None = None


class Attention(nn.Module):
    """Causal self-attention: ``n_head`` query heads share ``n_kv_head`` K/V heads."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_size = config.head_size
        self.query = nn.Linear(
            config.d_model, config.n_head * self.head_size, bias=False
        )
        self.key = nn.Linear(
            config.d_model, config.n_kv_head * self.head_size, bias=False
        )
        self.value = nn.Linear(
            config.d_model, config.n_kv_head * self.head_size, bias=False
        )
        self.proj = nn.Linear(
            config.n_head * self.head_size, config.d_model, bias=False
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Mask,
        cache: tuple[torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """(B, T, d_model) -> (B, T, d_model).

        ``cache`` (keys and values of every position so far, where this call's
        start) is written at ``start``, with ``n_kv_head`` heads only. SDPA's
        ``enable_gqa`` lets query head h read key/value head
        ``h // (n_head / n_kv_head)`` without copying them ``n_head`` times.
        """
        batch, steps, _ = x.shape
        q = self.query(x).view(batch, steps, self.n_head, self.head_size)
        k = self.key(x).view(batch, steps, self.n_kv_head, self.head_size)
        v = self.value(x).view(batch, steps, self.n_kv_head, self.head_size)
        q, k, v = (
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
        )  # (B, H, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # store k and v; attend to every position stored
            kv, start = cache
            kv[:, :, :, start : start + steps] = torch.stack((k, v))
            k, v = kv[:, :, :, : start + steps]
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask.tensor,
            is_causal=mask.causal,
            enable_gqa=self.n_kv_head != self.n_head,
        )
        return self.proj(y.transpose(1, 2).reshape(batch, steps, -1))


class SwiGLU(nn.Module):
    """The gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.mlp_size, bias=False)
        self.up = nn.Linear(config.d_model, config.mlp_size, bias=False)
        self.down = nn.Linear(config.mlp_size, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """One pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.norm_attn = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.norm_mlp = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Mask,
        cache: tuple[torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x), cos, sin, mask, cache)
        return x + self.mlp(self.norm_mlp(x))


@dataclass(frozen=True)
class Sampling:
    """How ``generate`` draws each token: temperature, then top-k, then top-p.

    ``top_p`` keeps the most likely tokens until their probabilities sum to at
    least ``top_p`` (nucleus sampling, Holtzman et al. 2020).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(
                f"Sampling.temperature must be > 0, got {self.temperature}"
            )
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"Sampling.top_k must be >= 1 or None, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(
                f"Sampling.top_p must be in (0, 1] or None, got {self.top_p}"
            )


def filtered_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """``logits`` (B, vocab) in float32 after temperature, top-k and top-p.

    The tokens filtered out are at -inf, so softmax gives them probability 0.
    """
    logits = logits.float() / sampling.temperature
    if sampling.top_k is not None:
        k = min(sampling.top_k, logits.size(-1))
        kth_largest = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampling.top_p is not None:
        # Keeping the most likely tokens until they hold top_p is dropping the
        # least likely while what they hold stays within 1 - top_p. Summed from
        # the least likely, as transformers' TopPLogitsWarper sums, the two
        # round alike and keep the same tokens where a sum lands next to p.
        ranked, order = logits.sort(dim=-1)  # least likely first
        dropped_mass = ranked.softmax(dim=-1).cumsum(dim=-1)
        drop_ranked = dropped_mass <= 1 - sampling.top_p
        drop_ranked[..., -1] = False  # the most likely token always stays
        drop = drop_ranked.scatter(-1, order, drop_ranked)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(
    logits: torch.Tensor,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token (B, 1) from the last position's ``logits`` (B, vocab).

    Greedy (the most likely token) when ``sampling`` is None; otherwise drawn
    on ``generator``'s device, so a seeded CPU generator gives the same tokens
    whatever device holds the model.
    """
    if sampling is None:
        return logits.argmax(dim=-1, keepdim=True)
    logits = filtered_logits(logits, sampling)
    device = generator.device if generator is not None else logits.device
    probs = logits.softmax(dim=-1).to(device)
    return torch.multinomial(probs, 1, generator=generator).to(logits.device)


class Llama(nn.Module):
    """A Llama-family decoder: (B, T) token ids -> (B, T, vocab) logits.

    No buffers: each call makes RoPE's tables for the positions it reaches
    (far smaller than the KV cache they serve), and the causal mask is SDPA's
    ``is_causal``, or none for one token after the cache, or built (``Mask``).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm_final = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:  # one Parameter, two uses, as in the book's GPT
            self.lm_head.weight = self.token_embedding.weight
        self.apply(init_weights)  # N(0, 0.02), as Hugging Face initialises

    def forward(
        self,
        idx: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: tuple[torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab_size) for token ids ``idx`` (B, T).

        Packed rows pass ``position_ids`` (restarting at 0 in each document, so
        each below T) and ``document_ids`` (B, T), as for the GPT; attention then
        stays inside each document. ``kv_cache``: ``(cache, start)``, see
        ``generate``; it keeps no document ids, so it takes one document per row.
        """
        start = 0 if kv_cache is None else kv_cache[1]
        end = start + idx.size(1)
        if idx.dtype not in (torch.int64, torch.int32) or idx.dim() != 2:
            raise ValueError(
                "Llama.forward: idx must be int64 or int32 token ids of shape "
                f"(batch, time), got {idx.dtype} of shape {tuple(idx.shape)}"
            )
        if end > self.config.max_positions:
            raise ValueError(
                f"Llama.forward: position {end - 1} is beyond max_positions="
                f"{self.config.max_positions}, the longest context of this model"
            )
        if document_ids is not None and kv_cache is not None:
            raise ValueError(
                "Llama.forward: document_ids cannot be combined with kv_cache, "
                "which keeps no document ids; generate one document per row"
            )
        if idx.device.type == "cpu" and not torch.compiler.is_compiling():
            check_token_ids(idx, self.config.vocab_size, where="Llama.forward: idx")
            if position_ids is not None:  # RoPE's tables have a row per position
                low, high = int(position_ids.min()), int(position_ids.max())
                if low < 0 or high >= end:
                    raise ValueError(
                        f"Llama.forward: position_ids run from {low} to {high}, "
                        f"outside [0, {end}), the positions of the row"
                    )
        inv_freq = rope_frequencies(self.config, idx.device)
        cos, sin = rope_tables(self.config.head_size, end, inv_freq=inv_freq)
        if position_ids is None:  # positions start..end-1, after those cached
            cos, sin = cos[start:], sin[start:]
        else:  # each token's own; (B, 1, T, head_size) broadcasts over the heads
            cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)
        if document_ids is not None:  # causal, and inside one document
            mask = Mask(tensor=document_causal_mask(document_ids))
        elif start == 0:  # no key before the first query: SDPA's is_causal
            mask = Mask(causal=True)
        elif idx.size(1) == 1:  # one new token: it sees every cached position
            mask = Mask()
        else:  # several after the cache: query at position p sees keys 0..p
            steps = torch.arange(start, end, device=idx.device)
            mask = Mask(tensor=steps[:, None] >= torch.arange(end, device=idx.device))

        x = self.token_embedding(idx)
        for layer, block in enumerate(self.blocks):
            cache = None if kv_cache is None else (kv_cache[0][:, layer], start)
            x = block(x, cos, sin, mask, cache)
        return self.lm_head(self.norm_final(x))

    def new_cache(self, batch: int, length: int, device: torch.device) -> torch.Tensor:
        """Zeros (2, n_layer, B, n_kv_head, length, head_size) for keys and values.

        In autocast's dtype when autocast is on (the dtype k and v have then),
        else the weights'. On the meta device it has a shape and no memory.
        """
        c, kind = self.config, torch.device(device).type
        dtype = self.token_embedding.weight.dtype
        if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
            dtype = torch.get_autocast_dtype(kind)
        shape = (2, c.n_layer, batch, c.n_kv_head, length, c.head_size)
        return torch.zeros(shape, device=device, dtype=dtype)

    @torch.inference_mode()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` tokens to ``idx`` (B, T): (B, T + new) token ids.

        Greedy when ``sampling`` is None. The prompt runs once, every position at
        once, filling the KV cache; each later step runs only the token chosen
        last. The model's train/eval mode is left as it is.
        """
        if max_new_tokens < 0:
            raise ValueError(
                f"Llama.generate: max_new_tokens must be >= 0, got {max_new_tokens}"
            )
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(
                "Llama.generate: idx must hold at least one token per row, shape "
                f"(batch, time >= 1), got shape {tuple(idx.shape)}"
            )
        cache = self.new_cache(idx.size(0), idx.size(1) + max_new_tokens, idx.device)
        logits = self(idx, kv_cache=(cache, 0))
        for step in range(max_new_tokens):
            token = next_token(logits[:, -1], sampling, generator)
            idx = torch.cat((idx, token.to(idx.dtype)), dim=1)
            if step + 1 < max_new_tokens:
                logits = self(token.to(idx.dtype), kv_cache=(cache, idx.size(1) - 1))
        return idx
