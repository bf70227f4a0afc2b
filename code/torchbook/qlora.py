"""QLoRA's frozen base by hand: linear layers stored in NF4, computed in bf16.

QLoRA (Dettmers et al. 2023) fine-tunes a model whose frozen linear layers are
stored in 4 bits (NF4) and dequantized to a 16-bit *compute dtype* as each
layer runs; LoRA adapters, added by ``torchbook.lora.add_lora`` on top of these
layers, are the only parameters that train. The linear weights then take about
4.13 bits each instead of bf16's 16: about a quarter of the memory.

- ``NF4Linear`` replaces a frozen ``nn.Linear``: it keeps the packed codes and
  scales as buffers (``model.to(device)`` moves them; cast the model to a
  dtype before quantizing, not after, or the float32 scales are cast too), and
  in ``forward`` dequantizes the weight to ``compute_dtype``, multiplies, and
  lets the 16-bit copy go. Backward dequantizes again instead of keeping that
  copy, as bitsandbytes does: kept, it would cost 16 bits per weight until
  backward, about four times the 4-bit storage, for every layer at once.
- ``quantize_linears`` swaps them in where transformers' ``BitsAndBytesConfig(
  load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
  bnb_4bit_compute_dtype=torch.bfloat16)`` puts bitsandbytes' ``Linear4bit``:
  every ``nn.Linear`` but the output head. Embeddings and norms are not
  linear layers and stay as they are.

The codes are bitsandbytes' byte for byte, and the layer computes what its
``Linear4bit`` computes on the CPU: the weight dequantized straight to the
compute dtype, then ``F.linear``. It builds on ``torchbook.nf4`` for the format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchbook.nf4 import NF4Weight, dequantize_nf4, quantize_nf4

QUANTIZED = ("codes", "scales", "scale_absmax", "scale_offset")  # NF4Weight tensors


class _NF4Matmul(torch.autograd.Function):
    """``x W^T + b`` with ``W`` dequantized in forward and again in backward.

    A plain ``F.linear(x, dequantize_nf4(q))`` would make autograd keep the
    dequantized ``W`` for the input's gradient; this keeps only ``q``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: NF4Weight, bias: torch.Tensor | None):
        ctx.q = q
        return F.linear(x, dequantize_nf4(q, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x = grad_out @ dequantize_nf4(ctx.q, grad_out.dtype)
        return grad_x, None, None  # the weight and the bias are frozen


class NF4Linear(nn.Module):
    """A frozen linear layer stored in NF4, computed in ``compute_dtype``.

    Its input is cast to ``compute_dtype`` and its output back to the input's
    dtype, as bitsandbytes' ``Linear4bit`` does.
    """

    def __init__(
        self,
        linear: nn.Linear,
        compute_dtype: torch.dtype = torch.bfloat16,
        blocksize: int = 64,
        double_quant: bool = True,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype
        q = quantize_nf4(linear.weight, blocksize, double_quant)
        self.shape, self.dtype, self.blocksize = q.shape, q.dtype, q.blocksize
        for name in QUANTIZED:
            self.register_buffer(name, getattr(q, name))
        bias = linear.bias
        if bias is not None:
            bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.bias = bias

    @property
    def nf4(self) -> NF4Weight:
        """The stored weight, on the device the buffers are on."""
        tensors = {name: getattr(self, name) for name in QUANTIZED}
        statistics = [self.scale_absmax, self.scale_offset]
        floats = [t for t in statistics if t is not None] or [self.scales]
        if any(t.dtype != torch.float32 for t in floats):
            raise TypeError(
                "NF4Linear: its float32 scales were cast to another dtype (by "
                "model.to(dtype) after quantize_linears?); cast before quantizing"
            )
        return NF4Weight(shape=self.shape, dtype=self.dtype, **tensors)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The (out, in) weight, in ``dtype`` (by default the one quantized)."""
        return dequantize_nf4(self.nf4, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        out = _NF4Matmul.apply(x.to(self.compute_dtype), self.nf4, bias)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"compute_dtype={self.compute_dtype}, bias={self.bias is not None}"
        )


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    """Whether ``name`` is one of ``skip``, or starts or ends with one at a dot."""
    return any(
        name == s or name.startswith(s + ".") or name.endswith("." + s) for s in skip
    )


def quantize_linears(
    model: nn.Module,
    skip: tuple[str, ...] = ("lm_head",),
    compute_dtype: torch.dtype = torch.bfloat16,
    double_quant: bool = True,
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` but those in ``skip`` by ``NF4Linear``.

    Returns ``model``, changed in place and frozen. The output head is skipped
    by default, as transformers does ("for numerical stability", its source
    says: every logit depends on it directly), and a head tied to the
    embedding shares the embedding's weight. Only exact ``nn.Linear`` layers
    are replaced, as transformers does: a subclass, such as
    ``nn.MultiheadAttention``'s output projection, may be used through its
    ``.weight`` instead of being called.
    """
    targets = [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and not _skipped(name, skip)
    ]
    if not targets:
        raise ValueError(
            f"quantize_linears: {type(model).__name__} has no nn.Linear outside "
            f"{skip}; nothing would be quantized"
        )
    model.requires_grad_(False)
    for name in targets:
        owner, _, attribute = name.rpartition(".")
        parent = model.get_submodule(owner) if owner else model
        layer = NF4Linear(getattr(parent, attribute), compute_dtype, 64, double_quant)
        setattr(parent, attribute, layer)
    return model


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of every ``NF4Linear``'s codes, scales and their statistics."""
    return sum(
        module.nf4.nbytes for module in model.modules() if isinstance(module, NF4Linear)
    )
