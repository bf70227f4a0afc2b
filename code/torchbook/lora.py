"""LoRA by hand: low-rank adapters on frozen linear layers, merged or saved for PEFT.

LoRA (Hu et al. 2021) fine-tunes a linear layer ``y = W x`` without changing
``W``: it learns two small matrices, ``A`` (r, in) and ``B`` (out, r), and
computes

    y = W x + (alpha / r) * B A x

``B`` starts at zero, so at step 0 the adapted model computes exactly what the
pretrained one does; ``A`` starts random (Kaiming-uniform, as ``nn.Linear``
and PEFT initialise it), so ``B``'s first gradient is not zero. Only ``A`` and
``B`` train: an optimizer built from them keeps gradients and AdamW moments
for ``r * (in + out)`` numbers per layer instead of ``in * out``.

- ``LoRALinear`` wraps a frozen linear layer (kept as ``.base``): an
  ``nn.Linear`` in any dtype, or a 4-bit one such as ``qlora.NF4Linear``
  (QLoRA). The adapters are float32 whatever the base's dtype, as in peft.
- ``add_lora`` wraps every linear layer whose name ends with one of
  ``LoRAConfig.targets`` and freezes every other parameter. It refuses an
  output head tied to the embedding (see its docstring).
- ``lora_optimizer``: AdamW over the adapters, with no weight decay by
  default (its docstring says why).
- ``merge_lora`` folds each adapter into its layer, ``W + (alpha / r) B A``,
  and puts a plain ``nn.Linear`` back: the model is again the base
  architecture, which any loader of it reads.
- ``save_peft_adapter`` writes only the adapters, as the ``peft`` library does
  (``adapter_model.safetensors`` and ``adapter_config.json``), so
  ``peft.PeftModel.from_pretrained`` loads them onto the base model.

It builds on ``torchbook.weights`` for writing the safetensors file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from torchbook.files import atomic_write_text
from torchbook.weights import save_safetensors

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# peft saves each adapter under the wrapped model's name: "base_model.model." + name.
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRAConfig:
    """Which layers get adapters, their rank ``r`` and the scale ``alpha / r``."""

    r: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("query", "value")  # last part of the layers' names

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"LoRAConfig.r must be >= 1, got {self.r}")
        if not self.targets:
            raise ValueError("LoRAConfig.targets is empty: no layer would be adapted")


def _weight_of(base: nn.Module) -> torch.Tensor:
    """A linear layer's (out, in) weight: ``nn.Linear``'s, or a 4-bit one's decoded."""
    return base.weight if isinstance(base, nn.Linear) else base.dequantize()


def is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear``, or a frozen stand-in for one that can ``dequantize()``
    its weight (as ``qlora.NF4Linear``): what ``add_lora`` adapts."""
    if isinstance(module, nn.Linear):
        return True
    return callable(getattr(module, "dequantize", None)) and hasattr(
        module, "in_features"
    )


class LoRALinear(nn.Module):
    """A frozen linear layer plus ``(alpha / r) * B A``, where only A and B train.

    A and B are float32 whatever the base's dtype, as peft keeps them (its
    ``autocast_adapter_dtype=True``): a bf16 base halves the frozen weights'
    memory, but in bf16 an AdamW step smaller than about 0.2% of the value it
    is added to rounds away. The input is cast up for the adapters, the update
    added to the base's output in float32, and the sum rounded once to the
    base's dtype, as peft's LoRA ``Linear`` does. Under autocast the matmuls
    run in autocast's dtype.
    """

    def __init__(self, base: nn.Module, r: int, alpha: float) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        device = next(t.device for t in [*base.parameters(), *base.buffers()])
        shape = dict(device=device, dtype=torch.float32)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, **shape))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, **shape))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's own init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        # x A^T B^T: two thin matmuls; the (out, in) product B A is never formed
        x = x.to(self.lora_A.dtype)
        update = x @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)
        return (out + update * self.scaling).to(out.dtype)

    def merged(self) -> nn.Linear:
        """A new frozen ``nn.Linear`` with ``W + (alpha / r) B A`` as its weight.

        This layer is left as it was, so calling it still adds the update once.
        The sum is formed in float32 and rounded once to the base's dtype; a
        4-bit base is decoded first, so its merged layer holds the quantized
        weights plus the update, in the dtype the base was quantized from.
        """
        with torch.no_grad():
            weight = _weight_of(self.base)
            delta = (self.lora_B @ self.lora_A) * self.scaling
            merged = (weight.float() + delta).to(weight.dtype)
        bias = self.base.bias
        linear = nn.Linear(
            self.base.in_features, self.base.out_features, bias is not None, "meta"
        )
        linear.weight = nn.Parameter(merged, requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return linear


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    owner, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attribute, module)


def _tied(model: nn.Module, name: str) -> list[str]:
    """The other modules that hold ``name``'s weight: an output head tied to the
    embedding holds the embedding's matrix itself."""
    weight = getattr(model.get_submodule(name), "weight", None)
    if not isinstance(weight, nn.Parameter):
        return []
    return [
        other
        for other, module in model.named_modules(remove_duplicate=False)
        if other != name and any(p is weight for p in module.parameters(recurse=False))
    ]


def add_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Freeze ``model`` and wrap each targeted linear layer in a ``LoRALinear``.

    Returns ``model``, changed in place; its trainable parameters are the
    adapters only. A ``ValueError`` says so, before anything changes, when no
    layer matches the targets or a target shares its weight with another
    module. That is a tied output head: merging its adapter would add the
    update into the embedding too (the merged model's logits then differ from
    the adapted one's), and a saved folder would still declare the head tied.
    peft warns in that case, and its ``target_modules="all-linear"`` leaves
    the output head out; the book refuses it.
    """
    targets = [
        name
        for name, module in model.named_modules()
        if is_linear(module) and name.rpartition(".")[2] in config.targets
    ]
    if not targets:
        raise ValueError(
            f"add_lora: no linear layer in {type(model).__name__} has a name "
            f"ending with one of {config.targets}"
        )
    for name in targets:
        tied = _tied(model, name)
        if tied:
            raise ValueError(
                f"add_lora: {name} shares its weight with {tied[0]} (tied "
                f"embeddings); merging an adapter on it would move {tied[0]} "
                f"too. Leave {name} out of the targets, or untie it first: "
                f"model.{name}.weight = nn.Parameter(model.{name}.weight.detach()"
                ".clone()), and turn the config's tie flag off before saving"
            )
    model.requires_grad_(False)
    for name in targets:
        _replace(
            model, name, LoRALinear(model.get_submodule(name), config.r, config.alpha)
        )
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Every ``LoRALinear`` in ``model``, by its name."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, LoRALinear)
    }


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' A and B, layer by layer: what the optimizer updates."""
    return [
        p for layer in lora_layers(model).values() for p in (layer.lora_A, layer.lora_B)
    ]


def lora_optimizer(
    model: nn.Module, lr: float, weight_decay: float = 0.0
) -> torch.optim.AdamW:
    """AdamW over the adapters alone, without weight decay unless asked.

    Why 0: decay pulls A and B toward zero, A's random start included, which
    is what lets B learn; and over a fine-tune of a few hundred steps it does
    little: each step multiplies them by ``1 - lr * weight_decay``, so 300
    steps at lr 2e-4 and decay 0.01 shrink them by 0.06%. The QLoRA paper's
    code sets it to 0 (regularising with LoRA dropout if at all);
    transformers' ``Trainer`` puts A and B in its decay group but defaults to
    ``weight_decay=0.0`` too. ``torch.optim.AdamW``'s own default is 0.01:
    pass it to compare.
    """
    return torch.optim.AdamW(lora_parameters(model), lr=lr, weight_decay=weight_decay)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer and put a plain ``nn.Linear`` back.

    Returns ``model``, changed in place. Its parameters stay frozen; call
    ``requires_grad_(True)`` to train all of them.
    """
    for name, layer in lora_layers(model).items():
        _replace(model, name, layer.merged())
    return model


def save_peft_adapter(
    model: nn.Module,
    folder: str | Path,
    rename: Callable[[str], str] = str,
    base_model: str = "",
) -> Path:
    """Save the adapters alone in ``peft``'s format; return the folder.

    ``rename`` maps a layer's name in ``model`` to its name in the model peft
    wraps (for the book's Llama, ``blocks.0.attn.query`` to
    ``model.layers.0.self_attn.q_proj``). ``base_model`` is written as
    ``base_model_name_or_path``, where peft looks for the base model by default.
    """
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{folder}: not written; the model has no LoRA adapters")
    tensors, names, ranks, alphas = {}, set(), set(), set()
    for name, layer in layers.items():
        peft_name = PEFT_PREFIX + rename(name)
        tensors[f"{peft_name}.lora_A.weight"] = layer.lora_A
        tensors[f"{peft_name}.lora_B.weight"] = layer.lora_B
        names.add(rename(name).rpartition(".")[2])
        ranks.add(layer.r)
        alphas.add(layer.alpha)
    if len(ranks) > 1 or len(alphas) > 1:
        raise ValueError(
            f"{folder}: not written; adapters of ranks {sorted(ranks)} and alphas "
            f"{sorted(alphas)}: one adapter_config.json describes one of each"
        )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": ranks.pop(),
        "lora_alpha": alphas.pop(),
        "lora_dropout": 0.0,
        "target_modules": sorted(names),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    folder = Path(folder)
    save_safetensors(tensors, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    atomic_write_text(folder / ADAPTER_CONFIG, json.dumps(config, indent=2) + "\n")
    return folder
