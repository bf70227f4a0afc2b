"""A model's ``state_dict`` across wrappers, and the check to run before loading it.

``torch.compile(model)`` keeps the model as ``_orig_mod`` and DDP as ``.module``;
each puts its attribute's name in front of every key, so a file saved from a
wrapper does not load into the plain model. Here is the one unwrap of a module
and of a ``state_dict``, and the one comparison of keys, shapes and dtypes that
``checkpoint``, ``weights`` and ``train`` make before loading: ``load_state_dict``
copies every tensor that fits before it raises, so a model checked afterwards
is already half-loaded. ``CheckpointError`` is the one error both file formats
(``torch.save`` in ``checkpoint``, safetensors in ``weights``) raise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

# The prefixes wrappers add to every key: torch.compile's OptimizedModule, then DDP.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")
LISTED_KEYS = 12  # an error lists at most this many keys, then how many more


class CheckpointError(Exception):
    """A weights or checkpoint file cannot be written or read as asked.

    The message names the file.
    """


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside torch.compile and DDP wrappers, however nested."""
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def unwrap_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The same entries without a wrapper prefix that every key has (however nested)."""
    unwrapped = dict(state_dict)
    while unwrapped and (
        prefix := next(
            (
                p
                for p in WRAPPER_PREFIXES
                if all(isinstance(key, str) and key.startswith(p) for key in unwrapped)
            ),
            None,
        )
    ):
        unwrapped = {key[len(prefix) :]: value for key, value in unwrapped.items()}
    return unwrapped


def listed(keys: Sequence[str]) -> str:
    """``a, b, c and 9 more``: at most ``LISTED_KEYS`` names, then how many more."""
    more = f" and {len(keys) - LISTED_KEYS} more" if len(keys) > LISTED_KEYS else ""
    return ", ".join(map(str, keys[:LISTED_KEYS])) + more


def state_dict_problems(model: nn.Module, state_dict: Mapping[str, Any]) -> list[str]:
    """Missing and unexpected keys, and tensors of another shape or dtype.

    Empty when ``state_dict`` fits ``model``.
    """
    expected = unwrap_model(model).state_dict()
    missing = [key for key in expected if key not in state_dict]
    unexpected = [str(key) for key in state_dict if key not in expected]
    problems = [
        f"{len(keys)} {kind} keys: {listed(keys)}"
        for kind, keys in (("missing", missing), ("unexpected", unexpected))
        if keys
    ]
    for key, target in expected.items():
        found = state_dict.get(key, target)
        if not isinstance(found, torch.Tensor):
            problems.append(
                f"{key}: a {type(found).__name__} in the file, expected a tensor"
            )
        elif (found.shape, found.dtype) != (target.shape, target.dtype):
            problems.append(
                f"{key}: {found.dtype} {tuple(found.shape)} in the file, "
                f"{target.dtype} {tuple(target.shape)} in the model"
            )
    return problems


def check_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], source: str | Path
) -> None:
    """Raise ``CheckpointError`` naming ``source`` unless ``state_dict`` fits ``model``.

    Nothing is loaded.
    """
    problems = state_dict_problems(model, state_dict)
    if problems:
        raise CheckpointError(
            f"{source}: does not fit {type(unwrap_model(model)).__name__} "
            "(architecture mismatch); nothing was loaded:\n  " + "\n  ".join(problems)
        )
