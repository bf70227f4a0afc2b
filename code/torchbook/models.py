"""The book's models: a small causal language model (GPT) and the tutorial TinyMLP.

The GPT is the classic pre-norm transformer, written to be read top to bottom:

    token embedding
    -> n_layer x [LayerNorm -> causal self-attention (RoPE, SDPA) -> + residual,
                  LayerNorm -> MLP (4x, GELU)                      -> + residual]
    -> final LayerNorm -> output head (weight tied to the token embedding) -> logits

Positions enter through rotary position embeddings (RoPE) applied to
queries and keys, so the model has no position-embedding parameters.
``forward`` returns logits only: the training loop computes the loss
itself, in float32.

Two options serve LLM training at scale:

- Packed sequences: ``forward(idx, position_ids=..., document_ids=...)``
  takes rows that hold several documents. Positions restart at 0 in each
  document (RoPE reads them) and attention stays inside each document (a
  block-diagonal causal mask), so each document is computed as if it were
  alone.
- ``GPTConfig(activation_checkpointing=True)`` keeps only each block's
  input during the forward pass and recomputes the block in the backward
  pass: less activation memory for one more forward.

Token ids outside ``[0, vocab_size)`` and positions outside
``[0, block_size)`` are refused with an error naming the value when the
input is on the CPU. On an accelerator they are not checked here: reading
them back would stall the device at every step, so check token ids on the
host before moving them (``check_token_ids``), where a data pipeline
already has them.

It builds on ``torchbook.decoder``, which holds what the GPT shares with
the Llama: RoPE's tables and rotation, the packed rows' mask, the id and
position checks and GPT-2's initialisation. With that module beside it,
it imports only torch (plus dataclasses and math): copy the two into a
project as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint

from torchbook.decoder import (
    INIT_STD,
    apply_rope,
    check_positions,
    check_token_ids,
    document_causal_mask,
    init_weights,
    rope_tables,
)

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

        Without ``attn_mask``, SDPA applies the causal mask itself
        (``is_causal=True``) and no (T, T) tensor exists. A boolean
        ``attn_mask`` (True = may attend) replaces it where the plain causal
        triangle is wrong: for packed rows, and with a KV cache, where a few new
        queries face a longer run of cached keys. ``cache`` is that layer's
        keys and values, (2, B, H, block_size, head_size), and the position at
        which this call's tokens start.
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


class GPT(nn.Module):
    """A small decoder-only language model: (B, T) token ids -> (B, T, vocab) logits.

    Buffers, all registered with ``persistent=False``:

    - ``causal_mask`` (block_size, block_size), bool, True on and below the
      diagonal. SDPA's ``is_causal=True`` does not need it; packed rows
      (``document_causal_mask``) and the KV cache do. It is not saved in
      ``state_dict`` because it is a pure function of ``block_size``: the
      config rebuilds it, and a checkpoint that carried it would only be
      larger and could disagree with the config.
    - ``rope_cos`` and ``rope_sin`` (block_size, head_size), float32: RoPE's
      tables, also derived from the config, so also not saved.

    Buffers move with ``.to(device)`` like parameters; ``.to(dtype)`` converts
    the floating-point ones (the RoPE tables) and leaves the bool mask alone.
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

        Each block adds two outputs to the stream (attention's ``proj`` and the
        MLP's), so at initialisation the stream's variance grows with the
        2 * n_layer additions. GPT-2 scales their standard deviation by
        1/sqrt(2 * n_layer), which keeps the stream's scale roughly
        independent of depth.
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

        For packed rows, ``position_ids`` (B, T) restart at 0 in each document
        and ``document_ids`` (B, T) say which document each token belongs to.
        ``kv_cache`` is ``generate``'s: every layer's keys and values
        (``_empty_cache``) and the number of positions already in it.
        ``return_hidden`` returns the final norm's output (B, T, d_model)
        instead of the logits, for a loss computed over slices of the
        sequence. There is no loss here: the training loop computes the
        cross-entropy itself, in float32 even under autocast.
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
                check_positions(position_ids, block_size, "GPT.forward: position_ids")
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

        Returns (B, T + max_new_tokens). Each step feeds at most the last
        block_size tokens, divides the last position's logits by
        ``temperature``, keeps the ``top_k`` largest if given, and draws from
        the softmax with ``generator``. Sampling runs on the generator's
        device, so a CPU generator draws the same random numbers whatever
        device holds the model. The model's train/eval mode is left as it is:
        call ``model.eval()`` first so dropout is off. ``use_cache`` keeps
        every layer's keys and values, so a step runs one position instead of
        the whole context while the sequence fits block_size; past that, each
        step runs the last block_size tokens again.
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
        """Zeros (2, n_layer, B, H, block_size, head_size) for keys and values.

        In autocast's dtype when autocast is on, since the keys and values
        that fill it come out of autocast's linear layers; else the weights'.
        """
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

    A tied weight (the GPT's embedding and head) is one Parameter, which
    ``parameters()`` yields once, so it is counted once: the count is what is
    stored and trained.
    """
    return sum(
        p.numel() for p in model.parameters() if p.requires_grad or not trainable_only
    )
