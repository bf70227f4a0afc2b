"""code/torchbook/lora.py: LoRA by hand, merged into the weights or saved for peft.

The references are the formula ``W x + (alpha / r) B A x`` computed apart,
transformers loading the merged model, and peft loading the adapters.
"""

from __future__ import annotations

import json
import logging

import peft
import pytest
import torch
import transformers
from torch import nn

from torchbook.hf_checkpoint import (
    CheckpointError,
    hf_module,
    load_pretrained,
    save_hf_folder,
)
from torchbook.llama import Llama, LlamaConfig
from torchbook.lora import (
    LoRAConfig,
    LoRALinear,
    add_lora,
    lora_layers,
    lora_optimizer,
    lora_parameters,
    merge_lora,
    save_peft_adapter,
)

LORA = LoRAConfig(r=4, alpha=8.0, targets=("query", "value", "down"))
# float32 logits of about 1: the adapted model and its merged or peft twin add
# the same products in another order, a few ulps (1.2e-7) per layer apart.
ATOL = RTOL = 1e-5


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """A tiny transformers Llama (grouped-query attention), saved as a folder."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    folder = tmp_path_factory.mktemp("base") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def trained_adapters(folder) -> nn.Module:
    """The base model with adapters whose B is no longer zero, as after training."""
    model = add_lora(load_pretrained(folder), LORA).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(std=0.5)
    return model


def ids(length: int = 12) -> torch.Tensor:
    return torch.randint(64, (2, length), generator=torch.Generator().manual_seed(2))


def test_logits_are_unchanged_at_step_0(base_folder):
    base = load_pretrained(base_folder).eval()
    with torch.no_grad():
        before = base(ids())
        after = add_lora(base, LORA)(ids())
    assert torch.equal(after, before)  # B = 0: the update is exactly zero


def test_only_the_adapters_train(base_folder):
    model = add_lora(load_pretrained(base_folder), LORA)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(lora_layers(model)) == 2 * 3 * 2
    assert all(name.endswith(("lora_A", "lora_B")) for name in trainable)

    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
    model(ids()).square().mean().backward()
    optimizer.step()

    changed = {n for n, p in model.named_parameters() if not torch.equal(p, frozen[n])}
    assert changed and all(name.endswith(("lora_A", "lora_B")) for name in changed)


def test_a_lora_layer_adds_scaled_b_a_x_to_the_frozen_layer():
    torch.manual_seed(0)
    base = nn.Linear(16, 8, bias=True)
    layer = LoRALinear(base, r=2, alpha=6.0)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(5, 16)
    delta = layer.lora_B @ layer.lora_A  # (out, in), formed here only
    expected = x @ (base.weight + 3.0 * delta).T + base.bias
    torch.testing.assert_close(layer(x), expected, atol=ATOL, rtol=RTOL)


def test_merging_keeps_the_logits_and_leaves_plain_linear_layers(base_folder):
    model = trained_adapters(base_folder)
    with torch.no_grad():
        adapted = model(ids())
        merged = merge_lora(model)
        assert not lora_layers(merged)
        torch.testing.assert_close(merged(ids()), adapted, atol=ATOL, rtol=RTOL)


def test_transformers_loads_the_merged_model_with_the_same_logits(
    base_folder, tmp_path
):
    model = trained_adapters(base_folder)
    with torch.no_grad():
        adapted = model(ids())
    folder = save_hf_folder(merge_lora(model), tmp_path / "merged", 50_000)
    loaded = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids()).logits, adapted, atol=ATOL, rtol=RTOL)


# peft 0.21 calls a transformers method that transformers 5 deprecates
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_peft_loads_the_adapters_with_the_same_logits(base_folder, tmp_path):
    model = trained_adapters(base_folder)
    folder = save_peft_adapter(model, tmp_path / "adapter", rename=hf_module)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]

    base = transformers.LlamaForCausalLM.from_pretrained(base_folder)
    logging.getLogger("peft").setLevel(logging.ERROR)
    adapted = peft.PeftModel.from_pretrained(base, folder).eval()

    with torch.no_grad():
        torch.testing.assert_close(
            adapted(ids()).logits, model(ids()), atol=ATOL, rtol=RTOL
        )


def test_the_merged_model_cannot_be_saved_unmerged(base_folder, tmp_path):
    with pytest.raises(CheckpointError, match="merge LoRA adapters first"):
        save_hf_folder(trained_adapters(base_folder), tmp_path / "unmerged", 50_000)


def test_targets_that_match_no_layer_are_refused(base_folder):
    with pytest.raises(ValueError, match="q_proj"):
        add_lora(load_pretrained(base_folder), LoRAConfig(targets=("q_proj",)))


def tied_llama() -> nn.Module:
    """The book's Llama with its head tied to the embedding, as small models ship."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        d_model=32,
        mlp_size=48,
        tie_embeddings=True,
    )
    return Llama(config).eval()


def test_a_tied_head_is_refused_before_anything_changes():
    model = tied_llama()
    with pytest.raises(ValueError, match=r"lm_head.*token_embedding"):
        add_lora(model, LoRAConfig(r=4, alpha=8.0, targets=("query", "lm_head")))
    assert not lora_layers(model)  # no layer was wrapped ...
    assert all(p.requires_grad for p in model.parameters())  # ... nor frozen


def test_an_untied_head_merges_with_the_same_logits():
    model = tied_llama()
    # the recipe the refusal gives: the head gets its own copy of the matrix
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    add_lora(model, LoRAConfig(r=4, alpha=8.0, targets=("query", "lm_head")))
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(std=0.5)
        adapted = model(ids())
        embedding = model.token_embedding.weight.clone()
        merged = merge_lora(model)(ids())
    assert torch.equal(model.token_embedding.weight, embedding)
    torch.testing.assert_close(merged, adapted, atol=ATOL, rtol=RTOL)


def test_adapters_on_a_bf16_base_stay_float32():
    torch.manual_seed(0)
    base = nn.Linear(16, 8, bias=True).to(torch.bfloat16)
    layer = LoRALinear(base, r=2, alpha=6.0)
    with torch.no_grad():
        layer.lora_B.normal_()
    assert layer.lora_A.dtype == layer.lora_B.dtype == torch.float32
    assert base.weight.dtype == torch.bfloat16 and not base.weight.requires_grad
    x = torch.randn(5, 16).to(torch.bfloat16)
    # the update in float32 on the float32 input, added to the base's output in
    # float32 and rounded once to the base's dtype (peft's LoRA Linear)
    update = x.float() @ layer.lora_A.T @ layer.lora_B.T * 3.0
    expected = (base(x).float() + update).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_add_lora_on_a_bf16_model_trains_float32_adapters(base_folder):
    model = add_lora(load_pretrained(base_folder).to(torch.bfloat16), LORA)
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert trainable == {torch.float32} and frozen == {torch.bfloat16}
    model(ids()).float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)


def test_merged_returns_a_new_layer_and_leaves_the_adapted_one_as_it_was():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(16, 8), r=2, alpha=6.0)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(5, 16)
    with torch.no_grad():
        before = layer(x)
        weight = layer.base.weight.clone()
        merged = layer.merged()
        after = layer(x)
    assert isinstance(merged, nn.Linear) and merged is not layer.base
    assert torch.equal(layer.base.weight, weight)
    assert torch.equal(after, before)  # the update is not added twice
    torch.testing.assert_close(merged(x), before, atol=ATOL, rtol=RTOL)


def test_the_adapter_optimizer_has_no_weight_decay_by_default(base_folder):
    model = add_lora(load_pretrained(base_folder), LORA)
    optimizer = lora_optimizer(model, lr=1e-3)
    (group,) = optimizer.param_groups
    assert group["weight_decay"] == 0.0 and group["lr"] == 1e-3
    assert {id(p) for p in group["params"]} == {id(p) for p in lora_parameters(model)}
    assert len(group["params"]) == 2 * len(lora_layers(model))
