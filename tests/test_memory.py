"""The memory and FLOPs model of torchbook.memory against measurements that do not use it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from torchbook.flops import count_training_flops, flops_per_token
from torchbook.memory import (
    FIT_SHARE,
    GPU_BYTES,
    TrainingShape,
    activation_terms,
    fit_table,
    gpu_run_peaks,
    parameter_count,
    peak_bytes,
    predict_memory,
    predict_peak,
    saved_activation_bytes,
    state_bytes,
    training_loss,
    training_step,
)
from torchbook.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, d_model=32)
SHAPE = TrainingShape(batch_size=3, seq_len=48)


def model_and_batch(
    config: GPTConfig, shape: TrainingShape
) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(config).train()
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(
        0, config.vocab_size, (shape.batch_size, shape.seq_len), generator=generator
    )
    return (
        model,
        idx,
        torch.randint(0, config.vocab_size, idx.shape, generator=generator),
    )


def measured_activations(config: GPTConfig, shape: TrainingShape) -> int:
    model, idx, targets = model_and_batch(config, shape)
    return saved_activation_bytes(
        model, lambda: training_loss(model, idx, targets, shape.precision)
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_saved_activations_match_the_hook_count_exactly(
    precision, checkpointing, dropout, batch_size
):
    config = replace(CONFIG, dropout=dropout, activation_checkpointing=checkpointing)
    shape = replace(
        SHAPE, batch_size=batch_size, precision=precision, checkpointing=checkpointing
    )
    # Exact: the formula names every saved tensor of this model; a missed one is a wrong formula.
    assert predict_memory(config, shape).activations == measured_activations(
        config, shape
    )


@pytest.mark.parametrize(
    "left_out",
    [
        "blocks",
        "embedding and ids",
        "final norm and head",
        "cross-entropy",
        "autocast weight copies",
    ],
)
def test_a_prediction_without_any_one_term_misses_the_measurement(left_out):
    shape = replace(SHAPE, precision="bf16")  # so that every term is present
    measured = measured_activations(CONFIG, shape)
    terms = activation_terms(CONFIG, shape)
    assert terms[left_out] > 0
    assert sum(terms.values()) - terms[left_out] != measured


def test_parameters_gradients_and_adamw_states_are_the_exact_tensor_bytes():
    model, idx, targets = model_and_batch(CONFIG, SHAPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    training_loss(model, idx, targets, "fp32").backward()
    optimizer.step()
    predicted = predict_memory(CONFIG, SHAPE)
    measured = state_bytes(model, optimizer)
    assert (predicted.parameters, predicted.gradients, predicted.optimizer_states) == (
        measured["parameters"],
        measured["gradients"],
        measured["optimizer_states"],
    )
    assert parameter_count(CONFIG) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "sharding, divided",
    [
        ("ddp", ()),
        ("zero1", ("optimizer_states",)),
        ("zero2", ("gradients", "optimizer_states")),
        ("fsdp", ("parameters", "gradients", "optimizer_states")),
    ],
)
def test_sharding_divides_what_each_zero_stage_shards(sharding, divided):
    alone = predict_memory(CONFIG, SHAPE)
    sharded = predict_memory(CONFIG, replace(SHAPE, sharding=sharding, world_size=4))
    for kind in ("parameters", "gradients", "optimizer_states"):
        expected = (
            -(-getattr(alone, kind) // 4) if kind in divided else getattr(alone, kind)
        )
        assert getattr(sharded, kind) == expected, kind
    assert sharded.activations == alone.activations, (
        "data parallelism never shards activations"
    )


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_predicted_peak_is_within_ten_percent_of_the_allocators(checkpointing, dropout):
    config = replace(CONFIG, dropout=dropout, activation_checkpointing=checkpointing)
    shape = replace(SHAPE, checkpointing=checkpointing)
    model, idx, targets = model_and_batch(config, shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # AdamW creates its states in the first step
    training_step(model, optimizer, idx, targets, "fp32")
    states = state_bytes(model, optimizer)
    measured = (
        states["parameters"]
        + states["optimizer_states"]
        + peak_bytes(
            lambda: training_step(model, optimizer, idx, targets, "fp32"),
            torch.device("cpu"),
        )
    )
    # 10%: the model follows the large tensors; the allocator also sees small temporaries.
    assert abs(predict_peak(config, shape) - measured) / measured < 0.10


def test_flops_per_token_equal_the_flop_counters():
    model, idx, targets = model_and_batch(CONFIG, SHAPE)
    counted = count_training_flops(model, idx, targets, "fp32")
    # Exact: both count the same matmuls (the counter on the math path of attention).
    assert (
        counted
        == flops_per_token(CONFIG, SHAPE.seq_len) * SHAPE.batch_size * SHAPE.seq_len
    )


def test_a_bad_precision_or_sharding_is_refused_by_name():
    with pytest.raises(ValueError, match="precision='fp8'"):
        TrainingShape(2, 8, precision="fp8")
    with pytest.raises(ValueError, match="sharding='zero4'"):
        TrainingShape(2, 8, sharding="zero4")


def test_every_gpu_run_fits_an_80_gb_gpu_with_half_to_spare():
    print("\n" + fit_table())  # pytest -s shows the figures
    for name, peak in gpu_run_peaks().items():
        assert peak <= FIT_SHARE * GPU_BYTES, (
            f"{name}: predicted peak {peak / 1e9:.1f} GB"
        )
