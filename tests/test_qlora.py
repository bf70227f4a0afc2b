"""code/torchbook/qlora.py: the book's QLoRA against transformers + bitsandbytes + peft.

The reference is a small Llama loaded by transformers with
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)`` and
wrapped by peft's ``get_peft_model`` with the same rank, alpha and targets. The
book quantizes the same bf16 weights with ``quantize_linears`` and adapts them
with ``add_lora``. Both run on the CPU, in training mode (the path a QLoRA step
takes: on a CPU with AVX512-BF16, bitsandbytes' inference mode switches to a
fused kernel of its own).
"""

from __future__ import annotations

import logging

import peft
import pytest
import torch
import transformers
from torch import nn

from torchbook.hf_checkpoint import hf_module, load_pretrained
from torchbook.lora import LoRAConfig, LoRALinear, add_lora, lora_layers, lora_optimizer
from torchbook.nf4 import dequantize_nf4
from torchbook.qlora import NF4Linear, quantize_linears, quantized_bytes

# peft 0.21 calls a transformers method that transformers 5 deprecates
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated"
)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 8, 16.0
VOCAB = 128
BNB = dict(
    load_in_4bit=True,
    bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=torch.bfloat16,
)
# bf16 keeps 8 significant bits: neighbouring values near x are x / 128 to
# x / 256 apart. Where the two models round differently (each adapted layer's
# output may round one such step apart, see below) the two blocks carry it to
# the logits: measured 2 steps of the largest logit; allowed 8 (3%).
BF16_STEPS = 8 * 2**-8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A small transformers Llama with random weights, saved in bf16.

    Widths of 96 and 160: blocks of 64 straddle the rows of every matrix.
    """
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("qlora") / "llama"
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def reference(folder) -> nn.Module:
    """transformers + bitsandbytes + peft: the QLoRA model readers build."""
    logging.getLogger("peft").setLevel(logging.ERROR)
    model = transformers.LlamaForCausalLM.from_pretrained(
        folder,
        quantization_config=transformers.BitsAndBytesConfig(**BNB),
        dtype=torch.bfloat16,
    )
    lora = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0
    )
    return peft.get_peft_model(model, lora).train()


def book(folder) -> nn.Module:
    """The same weights, quantized and adapted by the book's code."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    quantize_linears(model)
    return add_lora(model, LoRAConfig(r=RANK, alpha=ALPHA, targets=TARGETS)).train()


def peft_layer(reference_model: nn.Module, name: str) -> nn.Module:
    """peft's layer for one of the book's layer names."""
    return reference_model.base_model.model.get_submodule(name.removesuffix(".base"))


def ids() -> torch.Tensor:
    return torch.randint(VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))


def copy_adapters(source: nn.Module, target: nn.Module) -> None:
    """Give peft's adapters the book's A and B."""
    with torch.no_grad():
        for name, layer in lora_layers(source).items():
            theirs = peft_layer(target, name)
            theirs.lora_A["default"].weight.copy_(layer.lora_A)
            theirs.lora_B["default"].weight.copy_(layer.lora_B)


def test_the_same_layers_are_quantized_to_the_same_bytes(folder):
    ours, theirs = book(folder), reference(folder)
    quantized = {
        name.removesuffix(".base"): module
        for name, module in ours.named_modules()
        if isinstance(module, NF4Linear)
    }
    model = theirs.base_model.model
    expected = {
        name.removesuffix(".base_layer"): module
        for name, module in model.named_modules()
        if type(module).__name__ == "Linear4bit"
    }
    assert quantized.keys() == expected.keys() and len(quantized) == 2 * 7
    for name, layer in quantized.items():
        weight = expected[name].weight
        state = weight.quant_state
        assert torch.equal(layer.codes, weight.data.flatten()), name
        assert torch.equal(layer.scales, state.absmax), name
        assert torch.equal(layer.scale_absmax, state.state2.absmax), name
        assert torch.equal(layer.scale_offset, state.offset), name
    # what neither quantizes: the output head, the embedding and the norms
    assert type(ours.lm_head) is type(model.lm_head) is nn.Linear
    assert ours.lm_head.weight.dtype == torch.bfloat16
    assert quantized_bytes(ours) == sum(
        layer.nf4.nbytes for layer in quantized.values()
    )


def test_with_adapters_at_zero_the_logits_equal_bitsandbytes_and_peft(folder):
    # the same codes, dequantized to the same bf16 weights, multiplied by the
    # same F.linear: and B = 0 makes both adapters' updates exactly zero
    ours, theirs = book(folder), reference(folder)
    with torch.no_grad():
        assert torch.equal(ours(ids()).logits, theirs(ids()).logits)


def trained(folder) -> tuple[nn.Module, nn.Module]:
    """Both models with the same adapters, B no longer zero, as after training."""
    ours, theirs = book(folder), reference(folder)
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(ours).values():
            layer.lora_B.normal_(std=0.1)
    copy_adapters(ours, theirs)
    return ours, theirs


def test_with_trained_adapters_the_logits_agree_to_bf16_rounding(folder):
    ours, theirs = trained(folder)
    with torch.no_grad():
        logits, expected = ours(ids()).logits, theirs(ids()).logits
        for layer in lora_layers(ours).values():
            layer.lora_B.zero_()
        unadapted = ours(ids()).logits
    largest = expected.abs().max().item()
    gap = (logits.float() - expected.float()).abs().max().item()
    moved = (logits.float() - unadapted.float()).abs().max().item()
    assert gap <= BF16_STEPS * largest, f"{gap} apart, largest logit {largest}"
    assert moved >= 10 * BF16_STEPS * largest, "the adapters barely moved the logits"


def test_the_only_difference_is_where_the_update_is_rounded(folder, monkeypatch):
    # peft's layer for a 4-bit base rounds the scaled update to bf16 and adds
    # in bf16; its layer for an nn.Linear, and the book's for both, add in
    # float32 and round once. Made to round as peft's 4-bit layer does, the
    # book's model gives its logits to the bit.
    def rounded_first(self, x):
        out = self.base(x)
        x = x.to(self.lora_A.dtype)
        update = x @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)
        return out + (update * self.scaling).to(out.dtype)

    ours, theirs = trained(folder)
    monkeypatch.setattr(LoRALinear, "forward", rounded_first)
    with torch.no_grad():
        assert torch.equal(ours(ids()).logits, theirs(ids()).logits)


def qlora_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Forward, backward and an AdamW step; the loss, float32 from bf16 logits."""
    tokens = ids()
    logits = model(tokens).logits[:, :-1].float()
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def test_one_qlora_step_trains_only_the_float32_adapters_in_both(folder):
    ours, theirs = book(folder), reference(folder)
    copy_adapters(ours, theirs)  # the same random A, B = 0
    optimizers = (
        lora_optimizer(ours, lr=1e-3),
        torch.optim.AdamW(
            [p for p in theirs.parameters() if p.requires_grad], lr=1e-3, weight_decay=0
        ),
    )
    losses = []
    for model, optimizer in zip((ours, theirs), optimizers, strict=True):
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert len(trainable) == 2 * 2 * 7
        assert {p.dtype for p in trainable} == {torch.float32}
        frozen = {
            n: t.clone() for n, t in model.state_dict().items() if "lora" not in n
        }
        losses.append(qlora_step(model, optimizer))
        after = model.state_dict()
        assert all(torch.equal(after[name], frozen[name]) for name in frozen)
    # from B = 0 the two compute the same logits to the bit (above), and
    # backward runs the same operations: the same loss, the same step
    assert losses[0] == losses[1]
    for name, layer in lora_layers(ours).items():
        adapter = peft_layer(theirs, name)
        assert layer.lora_B.abs().max() > 0
        assert torch.equal(layer.lora_B, adapter.lora_B["default"].weight), name
        assert torch.equal(layer.lora_A, adapter.lora_A["default"].weight), name


def test_the_dequantized_weight_is_not_kept_for_backward():
    torch.manual_seed(0)
    layer = NF4Linear(nn.Linear(256, 128, bias=True).to(torch.bfloat16))
    x = torch.randn(4, 256, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.shape) or t, lambda t: t
    ):
        out = layer(x)
    assert (128, 256) not in saved and not any(s.numel() >= 128 * 256 for s in saved)
    out.float().sum().backward()
    weight = dequantize_nf4(layer.nf4, torch.bfloat16)
    expected = torch.ones(4, 128, dtype=torch.bfloat16) @ weight
    assert torch.equal(x.grad, expected)


def test_a_merged_4bit_layer_computes_what_the_adapted_one_did():
    torch.manual_seed(0)
    base = NF4Linear(nn.Linear(128, 64, bias=False).to(torch.bfloat16))
    layer = LoRALinear(base, r=4, alpha=8.0)
    with torch.no_grad():
        layer.lora_B.normal_(std=0.1)
        x = torch.randn(3, 128, dtype=torch.bfloat16)
        merged = layer.merged()
        adapted, plain = layer(x), merged(x)
    assert type(merged) is nn.Linear and merged.weight.dtype == torch.bfloat16
    # the merged weight is rounded to bf16 once more: a few bf16 steps
    assert (plain.float() - adapted.float()).abs().max() <= BF16_STEPS * (
        adapted.abs().max()
    )


def test_the_books_llama_is_quantized_like_transformers_model(folder):
    model = quantize_linears(load_pretrained(folder, dtype=torch.bfloat16))
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        folder,
        quantization_config=transformers.BitsAndBytesConfig(**BNB),
        dtype=torch.bfloat16,
    )
    layers = {n: m for n, m in model.named_modules() if isinstance(m, NF4Linear)}
    assert len(layers) == 2 * 7 and type(model.lm_head) is nn.Linear
    for name, layer in layers.items():
        weight = theirs.get_submodule(hf_module(name)).weight
        assert torch.equal(layer.codes, weight.data.flatten()), name

    add_lora(model, LoRAConfig(r=RANK, alpha=ALPHA, targets=("query", "value")))
    optimizer = lora_optimizer(model, lr=1e-3)
    tokens = ids()
    logits = model(tokens)[:, :-1].float()
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    assert all(layer.lora_B.abs().max() > 0 for layer in lora_layers(model).values())


def test_a_model_without_linear_layers_is_refused():
    with pytest.raises(
        ValueError, match="quantize_linears: Embedding has no nn.Linear"
    ):
        quantize_linears(nn.Embedding(10, 4))


def test_scales_cast_after_quantizing_are_refused_by_name():
    layer = NF4Linear(nn.Linear(64, 64).to(torch.bfloat16))
    layer.to(torch.bfloat16)  # casts the float32 scale statistics too
    with pytest.raises(TypeError, match="NF4Linear: its float32 scales were cast"):
        layer(torch.randn(1, 64, dtype=torch.bfloat16))
