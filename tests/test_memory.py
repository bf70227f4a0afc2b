"""The memory and FLOPs model of torchbook.memory against independent measurements."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from torchbook.book.gpu_fit import fit_table, gpu_run_peaks
from torchbook.device import autocast
from torchbook.loss import summed_loss
from torchbook.memory import TrainingSetup
from torchbook.memory.calculator import main
from torchbook.memory.fit import GPU_GIB, fits
from torchbook.memory.gpt import (
    activation_terms,
    kv_cache_bytes,
    parameter_count,
    predict_memory,
    predict_peak,
)
from torchbook.memory.measure import (
    ddp_bucket_bytes,
    growing_batch,
    peak_bytes,
    saved_activation_bytes,
    state_bytes,
    training_loss,
    training_step,
)
from torchbook.models import GPT, GPTConfig
from torchbook.recompute import checkpoint_blocks_selectively
from torchbook.train import TrainConfig, Trainer

CONFIG = GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, d_model=32)
SHAPE = TrainingSetup(batch_size=3, seq_len=48, kernels="cpu")
FP32_LOGITS = 4  # bytes of a float32 logit


def model_and_batch(
    config: GPTConfig, shape: TrainingSetup
) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(config).train()
    if shape.checkpointing == "selective":
        checkpoint_blocks_selectively(model)
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(
        0, config.vocab_size, (shape.batch_size, shape.seq_len), generator=generator
    )
    return (
        model,
        idx,
        torch.randint(0, config.vocab_size, idx.shape, generator=generator),
    )


def measured_activations(config: GPTConfig, shape: TrainingSetup) -> int:
    model, idx, targets = model_and_batch(config, shape)
    return saved_activation_bytes(
        model,
        lambda: training_loss(model, idx, targets, shape.precision, shape.loss_chunks),
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "checkpointing, dropout, loss_chunks",
    [
        ("none", 0.0, 1),
        ("none", 0.1, 1),
        ("none", 0.0, 4),
        ("selective", 0.0, 1),
        ("selective", 0.0, 3),
        ("full", 0.0, 1),
        ("full", 0.1, 4),
    ],
)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_saved_activations_match_the_hook_count_exactly(
    precision, checkpointing, dropout, loss_chunks, batch_size
):
    config = replace(
        CONFIG, dropout=dropout, activation_checkpointing=checkpointing == "full"
    )
    shape = replace(
        SHAPE,
        batch_size=batch_size,
        precision=precision,
        checkpointing=checkpointing,
        loss_chunks=loss_chunks,
    )
    # Exact: the formula names every saved tensor of this model; a missed one is a
    # wrong formula.
    assert predict_memory(config, shape).activations == measured_activations(
        config, shape
    )


def packed_rows_activations(config: GPTConfig, shape: TrainingSetup) -> int:
    """Saved bytes of a forward and loss over rows of packed documents."""
    model, idx, targets = model_and_batch(config, shape)
    steps = shape.seq_len
    starts = torch.tensor([0, steps // 3, steps // 2])  # three documents per row
    documents = (torch.arange(steps)[:, None] >= starts).sum(1) - 1
    positions = torch.arange(steps) - starts[documents]
    documents = documents.expand(shape.batch_size, steps)
    positions = positions.expand(shape.batch_size, steps)

    def forward() -> torch.Tensor:
        with autocast("cpu", shape.precision):
            logits = model(idx, position_ids=positions, document_ids=documents)
        return F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), reduction="sum"
        )

    return saved_activation_bytes(model, forward)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "checkpointing, dropout",
    [("none", 0.0), ("none", 0.1), ("selective", 0.0), ("full", 0.0), ("full", 0.1)],
)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_packed_rows_masks_and_positions_are_counted_exactly(
    precision, checkpointing, dropout, batch_size
):
    config = replace(
        CONFIG, dropout=dropout, activation_checkpointing=checkpointing == "full"
    )
    shape = replace(
        SHAPE,
        batch_size=batch_size,
        precision=precision,
        checkpointing=checkpointing,
        packed=True,
    )
    # Exact, as above: the fused CPU kernel's additive mask in every block, the
    # gathered RoPE rows, or the boolean mask a checkpointed block keeps.
    predicted = predict_memory(config, shape).activations
    assert predicted == packed_rows_activations(config, shape)


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
    sharded = predict_memory(CONFIG, replace(SHAPE, parallel=sharding, ranks=4))
    for kind in ("parameters", "gradients", "optimizer_states"):
        expected = (
            -(-getattr(alone, kind) // 4) if kind in divided else getattr(alone, kind)
        )
        assert getattr(sharded, kind) == expected, kind
    assert sharded.activations == alone.activations, (
        "data parallelism never shards activations"
    )


@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("loop", ["trainer", "tutorial"])
def test_predicted_peak_is_within_ten_percent_of_the_allocators(
    checkpointing, dropout, loop
):
    if checkpointing == "selective" and dropout:
        pytest.skip("selective checkpointing is predicted for dropout 0 only")
    config = replace(
        CONFIG, dropout=dropout, activation_checkpointing=checkpointing == "full"
    )
    shape = replace(SHAPE, checkpointing=checkpointing, loop=loop)
    model, idx, targets = model_and_batch(config, shape)
    if loop == "trainer":  # the book's own Trainer
        trainer = Trainer(model, TrainConfig(), "cpu")
        optimizer = trainer.optimizer

        def step() -> None:
            trainer.train_step([(idx, targets)])

    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step() -> None:
            training_step(model, optimizer, idx, targets, "fp32", loop)

    step()  # the optimizer creates its states in the first step
    states = state_bytes(model, optimizer)
    peak = peak_bytes(step, torch.device("cpu"))
    measured = states["parameters"] + states["optimizer_states"] + peak
    # 10%: the model follows large tensors; the allocator also sees small temporaries.
    assert abs(predict_peak(config, shape) - measured) / measured < 0.10


def test_the_tutorial_loop_peaks_higher_by_the_logits():
    config = replace(CONFIG, vocab_size=4096)  # so that the logits dominate
    trainer, tutorial = (
        predict_peak(config, replace(SHAPE, loop=loop))
        for loop in ("trainer", "tutorial")
    )
    assert tutorial - trainer == FP32_LOGITS * SHAPE.batch_size * SHAPE.seq_len * 4096


def test_peak_bytes_does_not_count_what_an_earlier_profiled_run_left():
    kept = []
    # a profiled 40 MB allocation that stays alive: the profiler's running total
    # includes it, so a measurement read as an absolute total counted it again
    peak_bytes(lambda: kept.append(torch.empty(40_000_000, dtype=torch.uint8)), "cpu")
    measured = peak_bytes(lambda: torch.empty(4000, dtype=torch.uint8), "cpu")
    assert 4000 <= measured < 8000  # the allocator may round a request up


def test_peak_bytes_refuses_a_device_it_cannot_measure():
    with pytest.raises(ValueError, match="device mps is not measured"):
        peak_bytes(lambda: None, torch.device("mps"))


def test_chunked_loss_and_gradients_equal_the_plain_ones():
    model, idx, targets = model_and_batch(CONFIG, SHAPE)
    results = []
    for chunks in (1, 4):
        loss = summed_loss(model, idx, targets, "fp32", chunks)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    (plain, plain_grads), (chunked, chunked_grads) = results
    # float32 rounding: the chunked sum adds the tokens in another order
    assert abs(chunked / plain - 1) <= 1e-6
    for a, b in zip(plain_grads, chunked_grads, strict=True):
        # each sum over 144 tokens in another order: a few float32 ulps of the largest
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_a_trainer_step_with_a_chunked_loss_equals_the_plain_step():
    weights = []
    for chunks in (1, 4):
        model, idx, targets = model_and_batch(CONFIG, SHAPE)
        Trainer(model, TrainConfig(loss_chunks=chunks), "cpu").train_step(
            [(idx, targets)]
        )
        weights.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*weights, strict=True):
        # AdamW's first step moves each weight by up to its warmup rate, 3e-6, in
        # the gradient's direction: a wrong gradient shows as up to 6e-6 apart;
        # float32 rounding of the same gradient, far less
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_loss_chunks_must_be_a_positive_int():
    with pytest.raises(ValueError, match="loss_chunks"):
        TrainConfig(loss_chunks=0)


def test_chunked_loss_keeps_fewer_bytes_than_the_plain_one():
    plain = measured_activations(CONFIG, SHAPE)
    chunked = measured_activations(CONFIG, replace(SHAPE, loss_chunks=4))
    tokens = SHAPE.batch_size * SHAPE.seq_len
    # cross-entropy's float32 log-probabilities (and its 4-byte total weight) are gone
    assert plain - chunked == tokens * FP32_LOGITS * CONFIG.vocab_size + 4


def test_selective_checkpointing_gives_equal_gradients_and_keeps_state_dict_keys():
    shape = replace(SHAPE, checkpointing="selective")
    grads = []
    for checkpointing in ("none", "selective"):
        model, idx, targets = model_and_batch(
            CONFIG, replace(shape, checkpointing=checkpointing)
        )
        training_loss(model, idx, targets, "fp32").backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)  # the same operations on the same inputs
    assert model.state_dict().keys() == GPT(CONFIG).state_dict().keys()


@pytest.mark.parametrize("top_k", [1, None])
def test_generation_with_a_kv_cache_equals_generation_without(top_k):
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    prompt = torch.randint(0, CONFIG.vocab_size, (2, 5))
    # past block_size the cached path runs the cropped context again, as without it
    outputs = [
        model.generate(
            prompt,
            CONFIG.block_size + 4,
            top_k=top_k,
            generator=torch.Generator().manual_seed(3),
            use_cache=use_cache,
        )
        for use_cache in (False, True)
    ]
    assert torch.equal(outputs[0], outputs[1])


def test_a_cached_forward_gives_the_logits_of_the_full_forward():
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9))
    cache = model._empty_cache(ids)
    with torch.inference_mode():
        full = model(ids)
        prompt = model(ids[:, :5], kv_cache=(cache, 0))
        continued = model(ids[:, 5:8], kv_cache=(cache, 5))  # three at once
        last = model(ids[:, 8:], kv_cache=(cache, 8))
    cached = torch.cat((prompt, continued, last), dim=1)
    # float32: the same products in other kernels (fused causal against masked)
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-6)


def test_the_kv_cache_allocates_the_predicted_bytes():
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    prompt = torch.randint(0, CONFIG.vocab_size, (2, 5))
    with torch.inference_mode():
        forward = peak_bytes(lambda: model(prompt), "cpu")
        generate = peak_bytes(lambda: model.generate(prompt, 1, use_cache=True), "cpu")
    # the cache is allocated whole (block_size positions) before the prompt's forward
    assert generate - forward == kv_cache_bytes(CONFIG, 2, CONFIG.block_size, 4)


def test_grouped_query_attention_divides_the_cache_by_the_group_size():
    full = kv_cache_bytes(CONFIG, 1, 100, 2)
    assert kv_cache_bytes(CONFIG, 1, 100, 2, kv_heads=1) * CONFIG.n_head == full
    with pytest.raises(ValueError, match="kv_heads=3 must divide n_head=4"):
        kv_cache_bytes(CONFIG, 1, 100, 2, kv_heads=3)


def test_growing_batch_refuses_a_device_without_a_caching_allocator():
    with pytest.raises(ValueError, match="device 'cpu' is not CUDA"):
        growing_batch("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_expandable_segments_reserve_less_for_a_growing_batch():
    import os
    import subprocess
    import sys

    code = "from torchbook.memory.measure import growing_batch; print(*growing_batch())"
    reserved = {}
    for expandable in (False, True):
        env = {
            **os.environ,
            "PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{expandable}",
        }
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, check=True
        )
        allocated, reserved[expandable] = map(int, run.stdout.split())
        assert reserved[expandable] >= allocated
    assert reserved[True] < reserved[False]


@pytest.mark.slow
def test_ddp_buckets_are_a_second_copy_of_the_gradients_unless_they_are_views():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    measured = ddp_bucket_bytes(model, port=29547)
    for bucket_view, (built, backward) in measured.items():
        shape = replace(
            SHAPE, parallel="ddp", ranks=2, gradient_as_bucket_view=bucket_view
        )
        predicted = predict_memory(CONFIG, shape)
        # 5% of the buckets: DDP's reducer keeps a few kB of its own (seen: 0 to
        # 4,096 B after the backward), next to buckets and gradients
        slack = 0.05 * predicted.gradient_buckets
        assert abs(built - predicted.gradient_buckets) <= slack
        # with views the gradients are the buckets: a backward adds about nothing
        assert abs(backward - predicted.gradients) <= slack


def test_the_calculator_prints_the_predicted_peak(capsys):
    assert (
        main(
            [
                "--layers",
                "2",
                "--width",
                "32",
                "--heads",
                "4",
                "--vocab",
                "96",
                "--seq",
                "48",
                "--batch",
                "3",
                "--precision",
                "fp32",
            ]
        )
        == 0
    )
    peak = predict_peak(CONFIG, SHAPE)
    assert f"{peak:,}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--batch", "0"], "argument --batch: must be >= 1, got 0"),
        (["--width", "-8"], "argument --width: must be >= 1, got -8"),
        (["--heads", "5"], "width 768 must be divisible by heads=5"),
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--checkpointing", "some"], "invalid choice"),
        (["--ranks", "8"], "ranks=8 with parallel='none'"),
        (["--precision", "bf16-pure"], "precision='bf16-pure': the book's GPT formula"),
    ],
)
def test_the_calculator_refuses_impossible_input_with_a_message(
    arguments, message, capsys
):
    with pytest.raises(SystemExit) as exit:
        main(arguments)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_the_calculator_has_help(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    assert "--loss-chunks" in capsys.readouterr().out


def test_a_chunked_bf16_loss_peaks_with_each_slices_copy_of_the_head():
    # The vocabulary's logits dominate, as they do in an LLM: each slice's backward
    # holds its head weight's bf16 copy and the head's and hidden states' gradients
    # summed over the slices before.
    config = replace(CONFIG, vocab_size=4096, block_size=128, d_model=64)
    shape = TrainingSetup(4, 128, "bf16", loss_chunks=4, kernels="cpu")
    model, idx, targets = model_and_batch(config, shape)
    trainer = Trainer(model, TrainConfig(precision="bf16", loss_chunks=4), "cpu")
    trainer.train_step([(idx, targets)])  # the optimizer creates its states
    states = state_bytes(model, trainer.optimizer)
    peak = peak_bytes(lambda: trainer.train_step([(idx, targets)]), "cpu")
    measured = states["parameters"] + states["optimizer_states"] + peak
    # 2%: the formula follows the step's tensors; the allocator also sees the CPU
    # attention kernel's scratch, small beside these logits (a missing head copy
    # made the prediction 4% low)
    assert abs(predict_peak(config, shape) - measured) / measured < 0.02


def test_the_formulas_sizes_are_the_packages_own():
    from torchbook.device import AUTOCAST_DTYPES
    from torchbook.memory import AUTOCAST_BYTES
    from torchbook.memory.gpt import MLP_EXPANSION
    from torchbook.models import MLP_EXPANSION as MODEL_MLP_EXPANSION

    # written out in memory.py so that the calculator answers without torch
    assert AUTOCAST_BYTES == {
        name: dtype.itemsize for name, dtype in AUTOCAST_DTYPES.items()
    }
    assert MLP_EXPANSION == MODEL_MLP_EXPANSION


def test_the_calculator_imports_neither_torch_nor_transformers(tmp_path):
    import json
    import subprocess
    import sys

    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 128,
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
            }
        ),
        encoding="utf-8",
    )
    code = (
        "import sys; from torchbook.memory.calculator import main; "
        f"main(['--config', {str(config)!r}, '--json']); main([]); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_a_bad_precision_sharding_or_lever_is_refused_by_name():
    with pytest.raises(ValueError, match="precision='fp8'"):
        TrainingSetup(2, 8, precision="fp8")
    with pytest.raises(ValueError, match="parallel='zero4'"):
        TrainingSetup(2, 8, parallel="zero4")
    with pytest.raises(ValueError, match="checkpointing=True"):
        TrainingSetup(2, 8, checkpointing=True)
    with pytest.raises(ValueError, match="tutorial loop has no chunked loss"):
        TrainingSetup(2, 8, loss_chunks=2, loop="tutorial")


@pytest.mark.parametrize(
    "changes", [{"precision": "bf16-pure"}, {"trains": "lora"}, {"optimizer": "none"}]
)
def test_the_gpt_formula_refuses_what_it_does_not_count(changes):
    with pytest.raises(ValueError, match="the book's GPT formula counts full training"):
        predict_peak(CONFIG, replace(SHAPE, **changes))


def test_every_gpu_run_fits_an_80_gib_gpu():
    print("\n" + fit_table())  # pytest -s shows the figures
    for name, peak in gpu_run_peaks().items():
        assert fits(peak, GPU_GIB), f"{name}: predicted peak {peak / 2**30:.1f} GiB"
