"""The calculator's 4-bit base checked against a measured QLoRA step on the CPU.

QLoRA (Dettmers et al. 2023) trains LoRA adapters on a frozen base stored in
4 bits: NF4 codes, two per byte, with an absmax scale per block of 64
weights, the scales themselves quantized to 8 bits (double quantization).
bitsandbytes stores and computes it, and it does so on the CPU too, so this
module measures a real QLoRA step instead of a fake one (a fake tensor cannot
be quantized): transformers loads a small model with
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)``,
peft's ``get_peft_model`` adds the adapters, and one step runs: forward,
loss, backward, AdamW's step, ``zero_grad``.

``measured_peak`` adds what exists before the second step (every storage of
the parameters, buffers, quantization constants and optimizer states, each
once) to the most that step allocates at once, from the CPU allocator's
records (``torchbook.memory.measure.peak_bytes``). ``saved_bytes`` counts what
the forward saves for the backward. Both are set beside
``torchbook.memory.peak.predict``'s prediction. It builds on
``torchbook.memory.configs`` (the architecture), ``torchbook.memory.step``
(what the formula counts), ``torchbook.memory.check`` (transformers' loss and
step, the optimizer) and ``torchbook.memory.measure`` (the allocator).
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from torchbook.memory import TrainingSetup
from torchbook.memory.check import make_optimizer, step_loss, training_step
from torchbook.memory.configs import Architecture, to_transformers_config
from torchbook.memory.measure import peak_bytes, saved_activation_bytes, storage_bytes
from torchbook.memory.step import check_setup, lora_targets

CPU = torch.device("cpu")


def quantization_config() -> object:
    """QLoRA's settings, as the QLoRA paper and transformers' documentation give."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def build_qlora_model(arch: Architecture, setup: TrainingSetup) -> nn.Module:
    """A random ``arch`` saved, loaded back in 4 bits, with peft's adapters.

    transformers quantizes a model as ``from_pretrained`` loads it, so the
    model is written to a temporary folder first (no hub involved). The parts
    it leaves unquantized (embeddings, norms, ``lm_head``) keep ``setup``'s
    dtype: bfloat16 for "bf16-pure", else float32.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    check_setup(arch, setup)
    if setup.base != "nf4" or setup.kernels != "cpu" or setup.parallel != "none":
        raise ValueError(
            "a measured QLoRA step needs base='nf4', kernels='cpu' and parallel='none'"
        )
    dtype = torch.bfloat16 if setup.precision == "bf16-pure" else torch.float32
    config = dict(to_transformers_config(arch))
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' advice on 4-bit loading
        AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            quantization_config=quantization_config(),
            dtype=dtype,
            device_map="cpu",
            attn_implementation="sdpa",
        )
    lora = LoraConfig(r=setup.lora_rank, target_modules=list(lora_targets(arch, setup)))
    model = get_peft_model(model, lora)
    if setup.checkpointing == "full":
        model.gradient_checkpointing_enable({"use_reentrant": False})
    elif setup.checkpointing != "none":
        raise ValueError("a measured QLoRA step checkpoints fully or not at all")
    return model.train()


def _held(value: object) -> Iterator[torch.Tensor]:
    """The tensors a quantization state holds, its nested state's too."""
    for held in vars(value).values():
        if torch.is_tensor(held):
            yield held
        elif hasattr(held, "absmax"):  # the scales' own state (double quantization)
            yield from _held(held)


def existing_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every storage the model and optimizer hold, each once.

    A 4-bit weight is a ``uint8`` parameter of packed codes; its scales and
    codebooks live in the ``quant_state`` beside it, which is no parameter
    and no buffer, so they are collected here.
    """
    tensors = [*model.parameters(), *model.buffers()]
    for parameter in model.parameters():
        state = getattr(parameter, "quant_state", None)
        if state is not None:
            tensors.extend(_held(state))
    for state in optimizer.state.values():
        tensors.extend(value for value in state.values() if torch.is_tensor(value))
    return storage_bytes(tensors)


def measured_peak(arch: Architecture, setup: TrainingSetup) -> int:
    """Peak bytes of a QLoRA step: what exists before it, plus its allocations.

    The first step makes AdamW's states, as in a real run; the second is
    measured.
    """
    torch.manual_seed(0)
    model = build_qlora_model(arch, setup)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(setup)(trained)
    ids = torch.randint(0, arch.vocab_size, (setup.batch_size, setup.seq_len))
    step = training_step(model, optimizer, ids, setup)
    step()
    return existing_bytes(model, optimizer) + peak_bytes(step, CPU)


def saved_bytes(arch: Architecture, setup: TrainingSetup) -> int:
    """Bytes autograd saves in a QLoRA model's forward and loss, each storage once.

    The packed 4-bit weights, which bitsandbytes' matmul keeps for the
    backward pass, exist anyway: like parameters, they are not counted.
    """
    torch.manual_seed(0)
    model = build_qlora_model(arch, setup)
    ids = torch.randint(0, arch.vocab_size, (setup.batch_size, setup.seq_len))
    return saved_activation_bytes(model, lambda: step_loss(model, ids, setup))
