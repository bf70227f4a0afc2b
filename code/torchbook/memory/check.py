"""The calculator checked against the real implementation, on fake tensors.

``torchbook.memory.step`` predicts a step's peak from a formula. This module
runs the step itself: transformers' own model (``AutoModelForCausalLM`` built
from the config, as ``from_pretrained`` would build it), peft's LoRA model,
or FSDP2's sharded model, one forward, loss, backward and optimizer step,
on fake tensors (``FakeTensorMode``: shapes and dtypes, no data), so a
7B-parameter step takes seconds and no memory. The book's tracker
(``torchbook.memory.tracker``, PyTorch's ``MemTracker``) follows the bytes of
every tensor the step creates and frees and reports the peak; for FSDP2 over
a fake process group it is ``FSDPMemTracker``, as torchtitan's memory
estimator runs it.

What the check covers: the CPU's operations (fake CUDA tensors need a CUDA
driver), so attention runs SDPA's CPU flash kernel (without dropout) or its
math path (with dropout), and autocast follows the CPU's op lists. What no
fake run sees: memory a kernel allocates inside itself (scratch buffers that
no operation returns) and everything outside the step's tensors (CUDA
context, workspaces, the allocator's cached blocks).

It builds on ``torchbook.memory.configs`` (the architecture),
``torchbook.memory.step`` (what the formula counts),
``torchbook.memory.tracker`` (the peak) and ``torchbook.recompute`` (the
selective checkpointing policy).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from unittest.mock import patch

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from torchbook.memory import TrainingSetup
from torchbook.memory.configs import Architecture, to_transformers_config
from torchbook.memory.step import check_setup, lora_targets
from torchbook.memory.tracker import PeakTracker, fsdp_tracker
from torchbook.recompute import keep_matmuls

DEVICE = torch.device("cpu")  # fake CUDA tensors need a CUDA driver
IGNORE = -100  # transformers' ignored label


def build_model(arch: Architecture, setup: TrainingSetup) -> nn.Module:
    """transformers' model for ``arch`` in ``setup``'s dtype, LoRA and checkpointing.

    Build it on the meta device and give it fake storage with ``fake_storage``:
    a fake parameter cannot be converted in place (peft converts adapters).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(to_transformers_config(arch))
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    fsdp_master = setup.precision == "bf16-master" and setup.parallel == "fsdp"
    bf16 = setup.precision in ("bf16-pure", "bf16-master") and not fsdp_master
    model = AutoModelForCausalLM.from_config(
        config,
        attn_implementation="sdpa",
        dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    if setup.trains == "lora":
        from peft import LoraConfig, get_peft_model

        targets = list(lora_targets(arch, setup))
        # GPT-2's Conv1D keeps its weight as (in, out): peft's fan_in_fan_out
        lora = LoraConfig(
            r=setup.lora_rank, target_modules=targets, fan_in_fan_out=not arch.gated
        )
        model = get_peft_model(model, lora)
    if setup.checkpointing == "full":
        model.activation_checkpointing_enable()
    elif setup.checkpointing == "selective":
        context = partial(create_selective_checkpoint_contexts, keep_matmuls)
        model.activation_checkpointing_enable(
            {"use_reentrant": False, "context_fn": context}
        )
    if setup.trains == "frozen":
        return model.requires_grad_(False).eval()
    return model.train()


def _slice_loss(
    weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    logits = F.linear(hidden, weight)  # the head, not called as a module again
    return F.cross_entropy(
        logits.float().flatten(0, 1),
        targets.flatten(),
        ignore_index=IGNORE,
        reduction="sum",
    )


def step_loss(
    model: nn.Module, ids: torch.Tensor, setup: TrainingSetup
) -> torch.Tensor:
    """transformers' loss (it shifts the labels), or the same in checkpointed slices."""
    autocast = torch.autocast(
        DEVICE.type, torch.bfloat16, enabled=setup.precision == "bf16"
    )
    with autocast:
        if setup.loss_chunks == 1:
            return model(input_ids=ids, labels=ids, use_cache=False).loss
        causal = model.get_base_model() if hasattr(model, "get_base_model") else model
        hidden = causal.base_model(input_ids=ids, use_cache=False).last_hidden_state
        head = causal.get_output_embeddings().weight
        targets = F.pad(ids[:, 1:], (0, 1), value=IGNORE)
        total = sum(
            checkpoint(_slice_loss, head, h, t, use_reentrant=False)
            for h, t in zip(
                hidden.chunk(setup.loss_chunks, 1),
                targets.chunk(setup.loss_chunks, 1),
                strict=True,
            )
        )
        return total / (ids.numel() - ids.shape[0])


class MasterWeights:
    """bf16 parameters with float32 master copies and gradients around an optimizer.

    Each bf16 gradient is added into its float32 copy's gradient as soon as it
    is complete, then dropped (Megatron-LM's "main_grad"); the step updates
    the float32 copies and copies them back into the bf16 parameters.
    """

    def __init__(self, parameters: list[nn.Parameter], make: Callable) -> None:
        self.parameters = [p for p in parameters if p.requires_grad]
        self.master = [p.detach().float() for p in self.parameters]
        self.optimizer = make(self.master)
        for parameter, master in zip(self.parameters, self.master, strict=True):
            parameter.register_post_accumulate_grad_hook(partial(self._add, master))

    @staticmethod
    def _add(master: torch.Tensor, parameter: nn.Parameter) -> None:
        if master.grad is None:
            master.grad = parameter.grad.float()
        else:
            master.grad.add_(parameter.grad)
        parameter.grad = None

    def step(self) -> None:
        self.optimizer.step()
        with torch.no_grad():
            for parameter, master in zip(self.parameters, self.master, strict=True):
                parameter.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def make_optimizer(setup: TrainingSetup) -> Callable | None:
    """A function from parameters to ``setup.optimizer`` (None for "none")."""
    choices = {
        "adamw": partial(torch.optim.AdamW, lr=1e-5, fused=True),
        "adamw-foreach": partial(torch.optim.AdamW, lr=1e-5, foreach=True),
        "sgd": partial(torch.optim.SGD, lr=1e-5, momentum=0.9),
    }
    return choices.get(setup.optimizer)


def training_step(
    model: nn.Module, optimizer: object | None, ids: torch.Tensor, setup: TrainingSetup
) -> Callable[[], None]:
    """The step transformers' Trainer runs: loss kept, logits dropped, then the step."""

    def step() -> None:
        if setup.trains == "frozen":
            with torch.no_grad():
                step_loss(model, ids, setup)
            return
        step_loss(model, ids, setup).backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)

    return step


def fake_storage(model: nn.Module) -> nn.Module:
    """A meta-device model's parameters and buffers as fake tensors, ties kept."""
    model.to_empty(device=DEVICE)
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    causal.tie_weights()  # to_empty made the tied matrix two parameters
    return model


@contextmanager
def _quiet() -> Iterator[None]:
    """No warnings or logs (transformers' and the trackers' advice), eager masks.

    To tell packed rows from plain ones transformers reads the position ids;
    it cannot read a fake tensor's values, so it takes the rows for packed and
    builds an explicit mask (and repeats the key/value heads for SDPA), which a
    real run of unpacked rows never does. The check says what a real run finds.
    """
    from transformers import masking_utils
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # and no log lines
    try:
        with (
            warnings.catch_warnings(),
            patch.object(
                masking_utils, "find_packed_sequence_indices", lambda ids: None
            ),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)


def fake_peak(arch: Architecture, setup: TrainingSetup) -> int:
    """Peak bytes of one training step of transformers' model on fake tensors.

    The first step makes the optimizer's states; the second is tracked.
    """
    check_setup(arch, setup)
    if setup.kernels != "cpu":
        raise ValueError("the fake run executes the CPU's kernels: kernels='cpu'")
    if setup.parallel == "fsdp":
        return fake_fsdp_peak(arch, setup)
    with _quiet(), torch.device("meta"):
        model = build_model(arch, setup)
    with _quiet(), FakeTensorMode(allow_non_fake_inputs=True), torch.device(DEVICE):
        model = fake_storage(model)
        make, optimizer, external = make_optimizer(setup), None, []
        if setup.precision == "bf16-master":
            optimizer = MasterWeights(list(model.parameters()), make)
            external = [optimizer.optimizer, *optimizer.master]
        elif make is not None:
            optimizer = make([p for p in model.parameters() if p.requires_grad])
            external = [optimizer]
        ids = torch.randint(0, arch.vocab_size, (setup.batch_size, setup.seq_len))
        step = training_step(model, optimizer, ids, setup)
        step()
        tracker = PeakTracker()
        tracker.track_external(model, *external)
        with tracker:
            step()
    return tracker.peak


class LocalShards:
    """An optimizer over each rank's shards, as DTensor's operations run it.

    Under fake tensors MemTracker also counts the global-shape tensors that
    DTensor's sharding propagation makes, so the check steps the local shards
    themselves: the same operations on the same tensors.
    """

    def __init__(self, model: nn.Module, make: Callable) -> None:
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            self.shards = [p.to_local() for p in self.parameters]
        self.optimizer = make(self.shards)

    def step(self) -> None:
        for parameter, shard in zip(self.parameters, self.shards, strict=True):
            shard.grad = parameter.grad.to_local()
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for parameter, shard in zip(self.parameters, self.shards, strict=True):
            parameter.grad = shard.grad = None


def fake_fsdp_peak(arch: Architecture, setup: TrainingSetup) -> int:
    """Peak bytes per rank of an FSDP2 step over a fake process group of ``ranks``.

    Each decoder layer and the root are ``fully_shard``-ed (bf16-master:
    ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=setup.ranks, store=FakeStore())
    try:
        mesh = init_device_mesh(DEVICE.type, (setup.ranks,))  # reads ranks: not fake
        policy = MixedPrecisionPolicy()
        if setup.precision == "bf16-master":
            policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        shard = partial(
            fully_shard,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=setup.reshard_after_forward,
        )
        with _quiet(), torch.device("meta"):
            model = build_model(arch, setup)
            for layer in (
                model.get_decoder().layers if arch.gated else model.transformer.h
            ):
                shard(layer)
            shard(model)
        with _quiet(), FakeTensorMode(allow_non_fake_inputs=True), torch.device(DEVICE):
            model = fake_storage(model)
            make = make_optimizer(setup)
            optimizer = None if make is None else LocalShards(model, make)
            ids = torch.randint(0, arch.vocab_size, (setup.batch_size, setup.seq_len))
            step = training_step(model, optimizer, ids, setup)
            step()
            tracker = fsdp_tracker(model, optimizer and optimizer.optimizer)
            with tracker:
                step()
        return tracker.peak
    finally:
        dist.destroy_process_group()
