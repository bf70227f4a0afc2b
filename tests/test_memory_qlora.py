"""The calculator's 4-bit base (QLoRA) against bitsandbytes and a measured step.

The storage of an NF4 matrix against what bitsandbytes' ``quantize_4bit``
makes; the parameters of a model transformers loads in 4 bits against the
formula, byte for byte; and the saved activations and the peak of a QLoRA
step on the CPU (transformers' ``BitsAndBytesConfig``, peft's
``get_peft_model``, real tensors, the allocator's records) against
``torchbook.memory.peak.predict``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from torchbook.memory import TrainingSetup
from torchbook.memory.configs import architecture
from torchbook.memory.peak import predict
from torchbook.memory.qlora_step import (
    build_qlora_model,
    measured_peak,
    quantization_config,
    saved_bytes,
)
from torchbook.memory.step import activation_terms, nf4_bytes, parameter_bytes

LLAMA = {  # untied: lm_head stays unquantized beside the embedding
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}
QLORA = TrainingSetup(2, 64, precision="fp32", trains="lora", base="nf4", kernels="cpu")
STEPS = {  # the model's dtype for what is not quantized, and the adapters' targets
    "float32": {},
    "bf16 autocast, every projection": {
        "precision": "bf16",
        "lora_targets": ("all-linear",),
    },
    "pure bf16": {"precision": "bf16-pure"},
}


@pytest.mark.parametrize("weights", [64 * 256, 256 * 688, 3 * 64 * 300])
def test_an_nf4_matrix_is_stored_as_the_formula_counts(weights):
    import bitsandbytes.functional as bnb

    matrix = torch.randn(weights // 64, 64)
    packed, state = bnb.quantize_4bit(
        matrix, blocksize=64, compress_statistics=True, quant_type="nf4"
    )
    held = [packed, state.absmax, state.code, state.offset]
    held += [state.state2.absmax, state.state2.code]
    # Exact: two codes a byte, an 8-bit scale per 64 weights, a float32 scale
    # per 256 scales, and the codebooks and the scales' mean per matrix.
    assert sum(t.numel() * t.element_size() for t in held) == nf4_bytes(weights)


def test_transformers_quantizes_the_projections_and_keeps_the_rest():
    config = quantization_config()
    assert (config.bnb_4bit_quant_type, config.bnb_4bit_use_double_quant) == (
        "nf4",
        True,
    )
    torch.manual_seed(0)
    model = build_qlora_model(architecture(LLAMA), QLORA)
    stored = {}
    for name, parameter in model.named_parameters():
        state = getattr(parameter, "quant_state", None)
        kind = "adapters" if "lora_" in name else "weights"
        kind = "4-bit base weights" if state is not None else kind
        tensors = [parameter]
        if state is not None:  # its scales and codebooks, beside the packed codes
            tensors += [state.absmax, state.code, state.offset]
            tensors += [state.state2.absmax, state.state2.code]
        stored[kind] = stored.get(kind, 0) + sum(t.nbytes for t in tensors)
    predicted = parameter_bytes(architecture(LLAMA), QLORA)
    assert stored == {
        "4-bit base weights": predicted["4-bit base weights"],
        "weights": predicted["unquantized weights"],
        "adapters": predicted["adapters"],
    }


@pytest.mark.slow
@pytest.mark.parametrize("step", sorted(STEPS))
def test_a_qlora_steps_saved_activations_are_counted_exactly(step):
    arch, setup = architecture(LLAMA), replace(QLORA, **STEPS[step])
    # Exact, as for every other model: a frozen 4-bit matmul keeps only its
    # packed weight, which exists anyway, and casts its output back to its
    # input's dtype.
    assert sum(activation_terms(arch, setup).values()) == saved_bytes(arch, setup)


@pytest.mark.slow
@pytest.mark.parametrize("step", sorted(STEPS))
def test_a_qlora_steps_peak_is_within_five_percent_of_the_allocators(step):
    arch, setup = architecture(LLAMA), replace(QLORA, **STEPS[step])
    measured = measured_peak(arch, setup)
    # 5%, the calculator's bound: the formula follows the step's tensors; the
    # allocator also sees the kernels' scratch and small temporaries.
    assert abs(predict(arch, setup).peak / measured - 1) < 0.05
