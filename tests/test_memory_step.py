"""A transformers model's step: the formula against the tensors the step really makes.

Saved activations against a ``saved_tensors_hooks`` count of transformers'
model; parameters, gradients and optimizer states against the tensors after a
real step; and the peak against a fake-tensor run (``torchbook.memory.check``)
of each family, precision, optimizer, LoRA, checkpointing, chunked loss and
FSDP2 over a fake process group, at small sizes (the bench runs 1B-8B).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from torchbook.memory import TrainingSetup
from torchbook.memory.check import build_model, fake_peak, make_optimizer, step_loss
from torchbook.memory.configs import architecture
from torchbook.memory.peak import predict
from torchbook.memory.step import activation_terms, state_bytes

SMALL = {  # every family's layout at a size a test runs in a second
    "llama": {
        "model_type": "llama",
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "mistral": {
        "model_type": "mistral",
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "sliding_window": 256,
    },
    "qwen2": {
        "model_type": "qwen2",
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "gpt2": {  # GPT-2's dropout 0.1 everywhere: on the CPU, attention's math path
        "model_type": "gpt2",
        "vocab_size": 1024,
        "n_embd": 128,
        "n_layer": 2,
        "n_head": 8,
        "n_positions": 256,
    },
}
SETUP = TrainingSetup(batch_size=2, seq_len=64, precision="bf16", kernels="cpu")
VARIANTS = {
    "bf16 autocast": {},
    "fp32": {"precision": "fp32"},
    "pure bf16": {"precision": "bf16-pure"},
    "LoRA": {"trains": "lora"},
    "LoRA everywhere, fp32": {
        "trains": "lora",
        "lora_targets": ("all-linear",),
        "precision": "fp32",
    },
    "LoRA, pure bf16": {"trains": "lora", "precision": "bf16-pure"},
    "chunked loss": {"loss_chunks": 4},
}


def saved_bytes(arch, setup: TrainingSetup) -> int:
    """Bytes autograd saves in transformers' forward and loss, each storage once."""
    torch.manual_seed(0)
    model = build_model(arch, setup)
    ids = torch.randint(0, arch.vocab_size, (setup.batch_size, setup.seq_len))
    existing = {t.untyped_storage().data_ptr() for t in model.parameters()}
    existing |= {t.untyped_storage().data_ptr() for t in model.buffers()}
    saved = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in existing:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step_loss(model, ids, setup)
    return sum(saved.values())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("family", sorted(SMALL))
def test_saved_activations_equal_the_hook_count_exactly(family, variant):
    arch = architecture(SMALL[family])
    setup = replace(SETUP, **VARIANTS[variant])
    # Exact: the formula names each tensor transformers' model saves; one missed
    # (or one saved only when a gradient needs it, counted always) is a wrong formula.
    assert sum(activation_terms(arch, setup).values()) == saved_bytes(arch, setup)


@pytest.mark.parametrize(
    "variant",
    [{}, {"precision": "bf16-pure"}, {"trains": "lora"}, {"optimizer": "sgd"}],
    ids=["autocast AdamW", "pure bf16", "LoRA", "SGD"],
)
def test_parameters_gradients_and_states_are_the_tensors_after_a_step(variant):
    arch = architecture(SMALL["llama"])
    setup = replace(SETUP, **variant)
    torch.manual_seed(0)
    model = build_model(arch, setup)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(setup)(trained)
    ids = torch.randint(0, arch.vocab_size, (setup.batch_size, setup.seq_len))
    step_loss(model, ids, setup).backward()
    optimizer.step()
    states = [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    measured = {
        "parameters": sum(p.nbytes for p in model.parameters()),
        "gradients": sum(p.grad.nbytes for p in trained),
        "optimizer_states": sum(t.nbytes for t in states),
    }
    predicted = state_bytes(arch, setup)
    assert {kind: predicted[kind] for kind in measured} == measured


# (family, setup changes): each family once, then every option on Llama, then FSDP2
PEAKS = [
    ("llama", {}),
    ("mistral", {}),
    ("qwen2", {}),
    ("gpt2", {}),
    ("llama", {"precision": "fp32"}),
    ("llama", {"precision": "bf16-pure"}),
    ("llama", {"precision": "bf16-master"}),
    ("llama", {"optimizer": "adamw-foreach", "checkpointing": "full"}),
    ("llama", {"optimizer": "sgd"}),
    ("llama", {"optimizer": "none"}),
    ("llama", {"trains": "lora"}),
    ("llama", {"trains": "frozen", "optimizer": "none"}),
    ("llama", {"checkpointing": "selective"}),
    ("llama", {"checkpointing": "full", "loss_chunks": 4}),
    ("gpt2", {"checkpointing": "full", "precision": "fp32"}),
    ("llama", {"parallel": "fsdp", "ranks": 4}),
    ("llama", {"parallel": "fsdp", "ranks": 4, "precision": "bf16-master"}),
    ("llama", {"parallel": "fsdp", "ranks": 4, "reshard_after_forward": False}),
    ("gpt2", {"parallel": "fsdp", "ranks": 2, "trains": "lora"}),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, changes",
    PEAKS,
    ids=[f"{f}-{'-'.join(map(str, c.values()))}" for f, c in PEAKS],
)
def test_the_peak_is_within_five_percent_of_a_fake_run(family, changes):
    arch = architecture(SMALL[family])
    setup = replace(SETUP, seq_len=128, **changes)
    measured = fake_peak(arch, setup)
    # 5%, the bound: the formula follows each tensor of the step, and
    # its moments (the loss's backward, a block's, the optimizer step) fall
    # where the fake run's peak falls, give or take a few small temporaries
    assert abs(predict(arch, setup).peak - measured) / measured < 0.05


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"ranks": 8}, "ranks=8 with parallel='none'"),
        ({"gradient_as_bucket_view": True}, "gradient_as_bucket_view is DDP's"),
        ({"reshard_after_forward": False}, "reshard_after_forward is FSDP2's"),
        ({"trains": "frozen"}, "a frozen model has no optimizer"),
        ({"lora_targets": ("q_proj",)}, "lora_targets without trains='lora'"),
        ({"trains": "lora", "precision": "bf16-master"}, "their own master copy"),
        ({"precision": "bf16-master", "optimizer": "none"}, "for an optimizer"),
        ({"parallel": "fsdp", "loss_chunks": 2}, "a chunked loss runs outside"),
        ({"precision": "fp8"}, "precision='fp8'"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"base": "nf4"}, "base='nf4' is QLoRA's frozen base"),
        ({"trains": "lora", "base": "nf4", "precision": "fp16"}, "not fp16"),
    ],
)
def test_a_meaningless_setup_is_refused_with_its_reason(changes, reason):
    with pytest.raises(ValueError, match=reason):
        replace(SETUP, **changes)


@pytest.mark.parametrize(
    "family, changes, reason",
    [
        ("llama", {"trains": "lora", "lora_targets": ("c_attn",)}, "not llama"),
        ("gpt2", {"seq_len": 512}, "past the 256 learned positions"),
        ("mistral", {"seq_len": 512}, "past the sliding window"),
        ("gpt2", {"checkpointing": "selective"}, "with dropout 0 only"),
    ],
)
def test_what_the_formula_does_not_count_is_refused(family, changes, reason):
    with pytest.raises(ValueError, match=reason):
        activation_terms(architecture(SMALL[family]), replace(SETUP, **changes))


def test_only_gpt2s_gelu_and_dropout_differ_between_cpu_and_cuda():
    llama = architecture(SMALL["llama"])
    on = {kernels: replace(SETUP, kernels=kernels) for kernels in ("cpu", "cuda")}
    assert activation_terms(llama, on["cpu"]) == activation_terms(llama, on["cuda"])
    gpt2 = architecture(SMALL["gpt2"])
    cpu, cuda = (activation_terms(gpt2, on[device])["blocks"] for device in on)
    assert cpu != cuda  # the math path (dropout), bool masks, float32 pow on CUDA


def test_sharding_divides_what_each_scheme_shards():
    arch = architecture(SMALL["llama"])
    alone = state_bytes(arch, SETUP)
    for parallel, divided in (
        ("ddp", ()),
        ("zero1", ("optimizer_states",)),
        ("zero2", ("gradients", "optimizer_states")),
        ("fsdp", ("parameters", "gradients", "optimizer_states")),
    ):
        sharded = state_bytes(arch, replace(SETUP, parallel=parallel, ranks=4))
        for kind in ("parameters", "gradients", "optimizer_states"):
            expected = -(-alone[kind] // 4) if kind in divided else alone[kind]
            assert sharded[kind] == expected, (parallel, kind)
    ddp = state_bytes(
        arch, replace(SETUP, parallel="ddp", ranks=2, gradient_as_bucket_view=True)
    )
    assert (ddp["gradients"], ddp["gradient_buckets"]) == (0, alone["gradients"])
