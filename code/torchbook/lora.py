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

- ``LoRALinear`` wraps a frozen ``nn.Linear`` (kept as ``.base``).
- ``add_lora`` wraps every linear layer whose name ends with one of
  ``LoRAConfig.targets`` and freezes every other parameter.
- ``merge_lora`` folds each adapter into its layer, ``W + (alpha / r) B A``,
  and puts the plain ``nn.Linear`` back: the model is again the base
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


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus ``(alpha / r) * B A``, where only A and B train."""

    def __init__(self, base: nn.Linear, r: int, alpha: float) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        weight = base.weight
        self.lora_A = nn.Parameter(
            torch.empty(r, base.in_features, dtype=weight.dtype, device=weight.device)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(base.out_features, r, dtype=weight.dtype, device=weight.device)
        )
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's own init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x A^T B^T: two thin matmuls; the (out, in) product B A is never formed
        update = x @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)
        return self.base(x) + update * self.scaling

    def merged(self) -> nn.Linear:
        """The base layer with ``W + (alpha / r) B A`` as its weight."""
        with torch.no_grad():
            delta = (self.lora_B.float() @ self.lora_A.float()) * self.scaling
            self.base.weight += delta.to(self.base.weight.dtype)
        return self.base


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    owner, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attribute, module)


def add_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Freeze ``model`` and wrap each targeted ``nn.Linear`` in a ``LoRALinear``.

    Returns ``model``, changed in place; its trainable parameters are the
    adapters only. A ``ValueError`` says so when no layer matches the targets.
    """
    model.requires_grad_(False)
    targets = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] in config.targets
    ]
    if not targets:
        raise ValueError(
            f"add_lora: no nn.Linear in {type(model).__name__} has a name ending "
            f"with one of {config.targets}"
        )
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


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer and put the plain ``nn.Linear`` back.

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
