"""The book's models: a small causal language model (GPT) and the tutorial TinyMLP.

The GPT is the classic pre-norm transformer, written to be read top to bottom:

    token embedding
    -> n_layer x [LayerNorm -> causal self-attention (RoPE, SDPA) -> + residual,
                  LayerNorm -> MLP (4x, GELU)                      -> + residual]
    -> final LayerNorm -> output head (weight tied to the token embedding) -> logits

Positions enter through rotary position embeddings (RoPE) applied to queries and
keys, so the model has no position-embedding parameters. ``forward`` returns
logits only: the training loop computes the loss itself, in float32.

Two options serve LLM training at scale. Packed rows,
``forward(idx, position_ids=..., document_ids=...)``, hold several documents:
positions restart at 0 in each, and attention stays inside each (a
block-diagonal causal mask), so each is computed as if alone.
``GPTConfig(activation_checkpointing=True)`` recomputes each block in the
backward pass: less activation memory for one more forward.

Token ids and positions out of range are refused, naming the value, on the CPU.
On an accelerator, reading them back would stall every step: check token ids
on the host before moving them (``check_token_ids``).

It imports only torch (plus dataclasses and math): copy it into a project as is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint

# Standard deviation of every weight at initialisation (GPT-2's): the first
# logits are nearly uniform, so the first loss is close to log(vocab_size).
INIT_STD = 0.02
# RoPE's base: rotation frequencies run from 1 down to about 1/ROPE_BASE
# radians per position, as in the RoFormer paper and most open LLMs.
ROPE_BASE = 10_000.0
# Width of the MLP's hidden layer relative to d_model.
MLP_EXPANSION = 4


@dataclass
class GPTConfig:
    """Shape of a GPT. Every size is here; nothing is hidden in the layers."""

    vocab_size: int
    # longest context; the causal mask buffer is (block_size, block_size)
    block_size: int
    n_layer: int
    n_head: int
    d_model: int
    dropout: float = 0.0
    # recompute each block in backward: memory for time
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"GPTConfig.{name} must be a positive int, got {value!r}"
                )
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} must be divisible by "
                f"n_head={self.n_head}"
            )
        if (self.d_model // self.n_head) % 2 != 0:
            raise ValueError(
                f"GPTConfig: head size d_model/n_head = {self.d_model // self.n_head} "
                "must be even, because RoPE rotates pairs of features"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}"
            )

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_head


def rope_tables(
    head_size: int,
    block_size: int,
    base: float = ROPE_BASE,
    inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables, each (block_size, head_size), for RoPE.

    Feature pair i of position t turns by t * inv_freq[i]: base**(-2i/head_size),
    or the frequencies given (Llama 3 rescales them), on their device. Both halves
    carry the same angles, as ``rotate_half`` below expects (the "split halves"
    convention of GPT-NeoX and Llama).
    """
    if inv_freq is None:
        pairs = torch.arange(0, head_size, 2, dtype=torch.float32)
        inv_freq = base ** (-pairs / head_size)
    positions = torch.arange(block_size, dtype=torch.float32, device=inv_freq.device)
    angles = torch.outer(positions, inv_freq)  # (block_size, head_size/2)
    angles = torch.cat((angles, angles), dim=-1)  # (block_size, head_size)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys ``x`` (B, H, T, head_size) by their positions' angles.

    The tables stay float32 under autocast; the result is cast back to x's dtype
    so that q, k and v reach attention with one dtype.
    """
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def document_causal_mask(
    document_ids: torch.Tensor, causal_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, 1, T, T) bool for packed rows: a query sees its own document's past only.

    ``causal_mask`` (True on and below the diagonal: the GPT's buffer, or built
    here) AND "same document"; the size-1 dimension broadcasts over the heads.
    """
    steps = document_ids.size(1)
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    if causal_mask is None:
        causal_mask = torch.ones_like(same_document[0]).tril()
    return (causal_mask[:steps, :steps] & same_document).unsqueeze(1)


def _check_range(ids: torch.Tensor, limit: int, what: str, expected: str) -> None:
    """Raise ValueError naming the first value of ``ids`` outside ``[0, limit)``."""
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        index = tuple(int(i) for i in (ids == bad).nonzero()[0])
        raise ValueError(f"{what} {bad} at position {index}, outside {expected}")


def check_token_ids(
    ids: torch.Tensor, vocab_size: int, where: str = "token ids"
) -> None:
    """Raise ValueError naming ``where`` and its first id outside ``[0, vocab_size)``.

    Call it on host tensors (a batch before ``.to(device)``): on an accelerator,
    reading ``ids.min()`` and ``ids.max()`` back waits for every queued kernel.
    """
    tokenizer = "was the data tokenized with another tokenizer?"
    expected = f"the vocabulary [0, {vocab_size}); {tokenizer}"
    _check_range(ids, vocab_size, f"{where} holds token id", expected)


def masked_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """Attention written out: softmax(q k^T / sqrt(d) with masked scores at -inf) v.

    ``mask`` is boolean, True where a query may look at a key. This is the
    textbook computation that ``F.scaled_dot_product_attention(..., is_causal=True)``
    replaces with a fused kernel that never materialises the (T, T) scores; it is
    the reference that tests and chapters compare SDPA with.
    """
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = F.dropout(scores.softmax(dim=-1), p=dropout_p, training=training)
    return weights @ v


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE on queries and keys."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)  # a residual projection
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        cache: tuple[torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """(B, T, d_model) -> (B, T, d_model).

        Without ``attn_mask``, SDPA applies the causal mask itself (``is_causal=True``)
        and no (T, T) tensor exists; a boolean ``attn_mask`` (True = may attend)
        replaces it, for packed rows or a KV cache (``cache``: keys, values, positions).
        """
        batch, steps, width = x.shape
        # (B, T, 3*C) -> (3, B, H, T, head_size): one matmul for q, k and v.
        qkv = self.qkv(x).view(batch, steps, 3, self.n_head, width // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # store k and v; attend to every position stored
            kv, start = cache
            kv[:, :, :, start : start + steps] = torch.stack((k, v))
            k, v = kv[:, :, :, : start + steps]
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=attn_mask is None,
            dropout_p=dropout_p,
        )
        y = y.transpose(1, 2).reshape(batch, steps, width)  # heads back side by side
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: d_model -> 4 d_model -> GELU -> d_model."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, MLP_EXPANSION * config.d_model)
        # a residual projection
        self.proj = nn.Linear(MLP_EXPANSION * config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        cache: tuple[torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        # Pre-norm: each sublayer reads a normalised copy of x and adds its output
        # back; the residual stream x itself is never normalised inside the block.
        x = x + self.attn(self.ln_attn(x), cos, sin, attn_mask, cache)
        return x + self.mlp(self.ln_mlp(x))


def init_weights(module: nn.Module) -> None:
    """Normal(0, 0.02) for linear and embedding weights, zero biases (``apply`` it).

    PyTorch's Embedding default, N(0, 1), would make a tied head's first logits
    huge; GPT-2's single small std gives near-uniform first predictions, so
    training starts near loss = log(vocab_size). Norm layers keep their default.
    """
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class GPT(nn.Module):
    """A small decoder-only language model: (B, T) token ids -> (B, T, vocab) logits.

    Its buffers are functions of the config, so they are registered with
    ``persistent=False``: they move with ``.to()`` but stay out of ``state_dict``,
    where they would only enlarge a checkpoint and could disagree with the config.
    ``causal_mask`` (block_size, block_size) is bool, True on and below the
    diagonal, for packed rows and the KV cache (``is_causal=True`` needs none);
    ``rope_cos`` and ``rope_sin`` (block_size, head_size) are float32 tables,
    which ``.to(dtype)`` converts while the mask stays bool.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_final = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Weight tying: the head that scores each token shares the matrix that
        # embeds it. One Parameter, two uses: vocab_size * d_model fewer weights.
        self.lm_head.weight = self.token_embedding.weight

        mask = torch.ones(config.block_size, config.block_size, dtype=torch.bool).tril()
        self.register_buffer("causal_mask", mask, persistent=False)
        cos, sin = rope_tables(config.head_size, config.block_size)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

        self.apply(init_weights)
        self._scale_residual_projections()

    def _scale_residual_projections(self) -> None:
        """Re-initialise the two projections that write into the residual stream.

        Each block adds two outputs to the stream, so at initialisation its
        variance grows with the 2 * n_layer additions; GPT-2 scales their std by
        1/sqrt(2 * n_layer), keeping the stream's scale roughly independent of depth.
        """
        std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=std)

    def forward(
        self,
        idx: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: tuple[torch.Tensor, int] | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Logits (B, T, vocab_size) for token ids ``idx`` (B, T), T <= block_size.

        For packed rows, ``position_ids`` (B, T) restart at 0 in each document and
        ``document_ids`` (B, T) say which document each token belongs to. No loss
        here: the training loop computes cross-entropy in float32 even under autocast.
        ``kv_cache``: see ``generate``; ``return_hidden``: the final norm's output.
        """
        block_size = self.config.block_size
        start = 0 if kv_cache is None else kv_cache[1]  # positions already cached
        end = start + idx.size(1)
        if (
            idx.dtype not in (torch.int64, torch.int32)
            or idx.dim() != 2
            or end > block_size
        ):
            raise ValueError(
                "GPT.forward: idx must be int64 or int32 token ids of shape (batch, "
                f"time) with time <= block_size={block_size}, got {idx.dtype} of shape "
                f"{tuple(idx.shape)}"
            )
        for name, ids in (
            ("position_ids", position_ids),
            ("document_ids", document_ids),
        ):
            if ids is not None and ids.shape != idx.shape:
                raise ValueError(
                    f"GPT.forward: {name} must have idx's shape {tuple(idx.shape)}, "
                    f"got {tuple(ids.shape)}"
                )
        if document_ids is not None and kv_cache is not None:
            raise ValueError(
                "GPT.forward: document_ids cannot be combined with kv_cache, which "
                "keeps no document ids for its positions; generate one document per row"
            )
        # On the CPU only, where reading values costs no device sync; compiled kernels
        # check their own indices, and fake tensors (the GPU dry run's) have no values.
        if (
            idx.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and not is_fake(idx)
        ):
            check_token_ids(idx, self.config.vocab_size, where="GPT.forward: idx")
            if position_ids is not None:  # RoPE's tables have a row per position
                where = "GPT.forward: position_ids holds"
                _check_range(position_ids, block_size, where, f"[0, {block_size=})")
        if position_ids is None:  # positions start..end-1, after those cached
            cos, sin = self.rope_cos[start:end], self.rope_sin[start:end]
        else:  # each token's own position; (B, 1, T, head_size) broadcasts over heads
            cos = self.rope_cos[position_ids].unsqueeze(1)
            sin = self.rope_sin[position_ids].unsqueeze(1)
        attn_mask = None  # SDPA's own causal mask (is_causal=True)
        if document_ids is not None:  # packed rows: causal within each document
            attn_mask = document_causal_mask(document_ids, self.causal_mask)
        elif kv_cache is not None:  # each query sees the cached keys and its own
            attn_mask = self.causal_mask[start:end, :end]
        recompute = (
            self.config.activation_checkpointing
            and self.training
            and torch.is_grad_enabled()
        )

        # (B, T, d_model), no position embedding
        x = self.dropout(self.token_embedding(idx))
        for layer, block in enumerate(self.blocks):
            if recompute:  # keep only the block's inputs; rerun it during backward
                x = checkpoint(block, x, cos, sin, attn_mask, use_reentrant=False)
            else:
                cache = None if kv_cache is None else (kv_cache[0][:, layer], start)
                x = block(x, cos, sin, attn_mask, cache)
        x = self.ln_final(x)
        # lm_head shares token_embedding's weight (tied): each logit is the dot product
        # of the final hidden state with one token's embedding.
        return x if return_hidden else self.lm_head(x)

    @torch.inference_mode()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to the prompt ``idx`` (B, T >= 1).

        Returns (B, T + max_new_tokens). Each step feeds at most the last block_size
        tokens, divides the last logits by ``temperature``, keeps the ``top_k``
        largest if given, and draws with ``generator`` on its device, so a CPU
        generator draws the same numbers whatever device holds the model. Call
        ``model.eval()`` first. ``use_cache`` keeps every layer's keys and values,
        so a step runs one position while they fit block_size.
        """
        if idx.dim() != 2 or idx.size(1) == 0:  # the first draw reads the last token
            raise ValueError(
                "GPT.generate: idx must hold at least one token per row to continue "
                f"from, shape (batch, time), got shape {tuple(idx.shape)}"
            )
        if max_new_tokens < 0:
            raise ValueError(
                f"GPT.generate: max_new_tokens must be >= 0, got {max_new_tokens}"
            )
        if temperature <= 0:
            raise ValueError(
                f"GPT.generate: temperature must be > 0, got {temperature}"
            )
        if top_k is not None and top_k < 1:
            raise ValueError(f"GPT.generate: top_k must be >= 1 or None, got {top_k}")
        sample_device = generator.device if generator is not None else idx.device
        cache = None
        for _ in range(max_new_tokens):
            if not use_cache or idx.size(1) > self.config.block_size:
                logits = self(idx[:, -self.config.block_size :])
            elif cache is None:  # the prompt, every position at once
                cache = self._empty_cache(idx)
                logits = self(idx, kv_cache=(cache, 0))
            else:  # the token sampled last
                logits = self(idx[:, -1:], kv_cache=(cache, idx.size(1) - 1))
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                k = min(top_k, logits.size(-1))
                kth_largest = torch.topk(logits, k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth_largest, float("-inf"))
            probs = logits.softmax(dim=-1).to(sample_device)
            next_token = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat(
                (idx, next_token.to(device=idx.device, dtype=idx.dtype)), dim=1
            )
        return idx

    def _empty_cache(self, idx: torch.Tensor) -> torch.Tensor:
        """Zeros (2, n_layer, B, H, block_size, head_size), autocast's dtype if on."""
        c, device = self.config, idx.device.type
        dtype = self.token_embedding.weight.dtype
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        shape = (2, c.n_layer, idx.size(0), c.n_head, c.block_size, c.head_size)
        return torch.zeros(shape, device=idx.device, dtype=dtype)


class TinyMLP(nn.Module):
    """The tutorial version of a small MLP: Linear -> GELU -> Linear."""

    def __init__(
        self, in_features: int = 64, hidden: int = 256, out_features: int = 10
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of scalar parameters in ``model`` (by default only trainable ones).

    A tied weight (the GPT's embedding and head) is one Parameter, counted once.
    """
    return sum(
        p.numel() for p in model.parameters() if p.requires_grad or not trainable_only
    )
