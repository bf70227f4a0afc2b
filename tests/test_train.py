"""The training loop (train.py, loss.py) and its saved state (trainer_state.py).

Each checked against an independent computation.
"""

from __future__ import annotations

import copy
import itertools
import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchbook.optim import build_optimizer, learning_rate
from torchbook.train import (
    IGNORE_INDEX,
    MAX_SKIPS_IN_A_ROW,
    NonFiniteLossError,
    TrainConfig,
    Trainer,
    evaluate,
)
from torchbook.trainer_state import StepResult

CPU = torch.device("cpu")
VOCAB, WIDTH, BLOCK = 11, 16, 6


class TinyLM(nn.Module):
    """(B, T) token ids -> (B, T, V) logits.

    Embedding, LayerNorm, a biased hidden layer, a head.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.norm(self.embed(idx)))))


def make_model(seed: int = 0) -> TinyLM:
    # keep the test's initialisation out of the global RNG
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return TinyLM()


def token_batch(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (batch, BLOCK), generator=generator)
    y = torch.randint(0, VOCAB, (batch, BLOCK), generator=generator)
    return x, y


def split(
    x: torch.Tensor, y: torch.Tensor, sizes: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(x.split(sizes), y.split(sizes), strict=True))


def big_batch_gradients(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The reference: one forward and backward of the mean loss over the whole batch."""
    model.zero_grad(set_to_none=True)
    logits = model(x)
    F.cross_entropy(
        logits.flatten(0, -2), y.flatten(), ignore_index=IGNORE_INDEX
    ).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def config(**overrides) -> TrainConfig:
    settings = dict(max_steps=20, lr=1e-2, min_lr=1e-3, warmup_steps=2, log_every=1)
    settings.update(overrides)
    return TrainConfig(**settings)


# Tolerances: micro-batch accumulation sums the same float32 terms in a different order,
# which moves results by a few float32 ulps (~1e-7 relative); 1e-5 / 1e-7 leaves margin.
RTOL, ATOL = 1e-5, 1e-7


@pytest.mark.parametrize(
    "sizes, ignore_fraction",
    [([4, 4, 4, 4], 0.0), ([2, 7, 3], 0.0), ([4, 4, 4, 4], "uneven")],
    ids=["equal-blocks", "unequal-blocks", "ignored-tokens-uneven"],
)
def test_accumulated_gradients_equal_one_big_batch(sizes, ignore_fraction):
    x, y = token_batch(sum(sizes), seed=1)
    if ignore_fraction == "uneven":
        y = y.clone()
        # the first micro-batch is mostly ignored, the others not at all
        y[:3] = IGNORE_INDEX
        y[5, :4] = IGNORE_INDEX
    reference = big_batch_gradients(make_model(), x, y)

    model = make_model()
    trainer = Trainer(model, config(accum_steps=len(sizes)), CPU)
    trainer.accumulate_gradients(split(x, y, sizes))
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            p.grad, reference[name], rtol=RTOL, atol=ATOL, msg=name
        )


def test_naive_division_by_k_is_wrong_when_ignored_tokens_are_uneven():
    """The check above has teeth: a mean of micro-batch means gives another gradient."""
    x, y = token_batch(8, seed=2)
    y = y.clone()
    y[:3] = IGNORE_INDEX
    reference = big_batch_gradients(make_model(), x, y)
    model = make_model()
    for xs, ys in split(x, y, [4, 4]):
        (F.cross_entropy(model(xs).flatten(0, -2), ys.flatten()) / 2).backward()
    assert not torch.allclose(
        model.head.weight.grad, reference["head.weight"], rtol=1e-3
    )


def test_accumulated_step_updates_weights_like_one_big_batch():
    x, y = token_batch(12, seed=3)
    big, accumulated = make_model(), make_model()
    big_trainer = Trainer(big, config(accum_steps=1), CPU)
    accumulated_trainer = Trainer(accumulated, config(accum_steps=3), CPU)
    for step in range(3):
        xs, ys = token_batch(12, seed=10 + step)
        big_trainer.train_step([(xs, ys)])
        accumulated_trainer.train_step(split(xs, ys, [4, 4, 4]))
    for (name, p), q in zip(
        big.named_parameters(), accumulated.parameters(), strict=True
    ):
        # AdamW divides by sqrt(v): a 1e-7 relative change in a gradient moves the
        # update by about as much, so the float32 tolerance above still holds for the
        # weights.
        torch.testing.assert_close(q, p, rtol=RTOL, atol=1e-6, msg=name)


def test_a_short_final_group_is_one_normalised_step():
    """7 micro-batches, accum_steps=3: steps of 3, 3 and a final partial group of 1."""
    micro_batches = [token_batch(2, seed=20 + i) for i in range(7)]
    reference = make_model()
    reference_trainer = Trainer(reference, config(accum_steps=1), CPU)
    for group in ([0, 1, 2], [3, 4, 5], [6]):  # each group as one big batch
        reference_trainer.train_step(
            [
                (
                    torch.cat([micro_batches[i][0] for i in group]),
                    torch.cat([micro_batches[i][1] for i in group]),
                )
            ]
        )

    model = make_model()
    trainer = Trainer(model, config(accum_steps=3), CPU)
    batches = iter(micro_batches)
    # the loop a script writes around train_step
    while group := list(itertools.islice(batches, 3)):
        trainer.train_step(group)
    assert trainer.step == 3, (
        f"expected 3 optimizer steps from 7 micro-batches, got {trainer.step}"
    )
    for (name, p), q in zip(
        reference.named_parameters(), model.parameters(), strict=True
    ):
        torch.testing.assert_close(q, p, rtol=RTOL, atol=1e-6, msg=name)


def test_clipping_caps_the_norm_and_returns_the_norm_before_clipping():
    x, y = token_batch(8, seed=4)
    model = make_model()
    trainer = Trainer(model, config(max_grad_norm=0.01), CPU)
    trainer.accumulate_gradients([(x, y)])
    norm_before = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert norm_before > 0.01, "the test needs a gradient larger than max_grad_norm"

    returned = trainer.clip_gradients()

    norm_after = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    # rtol 1e-5: two float32 reductions in different orders; clipping multiplies by
    # max_norm / (norm + 1e-6), so the clipped norm sits just under max_norm.
    torch.testing.assert_close(returned, norm_before, rtol=1e-5, atol=0.0)
    assert norm_after <= 0.01 * (1 + 1e-5), (
        f"clipped norm {norm_after} exceeds max_grad_norm 0.01"
    )
    torch.testing.assert_close(norm_after, torch.tensor(0.01), rtol=1e-3, atol=0.0)


def test_history_records_the_gradient_norm_before_clipping():
    x, y = token_batch(8, seed=5)
    reference = make_model()
    F.cross_entropy(reference(x).flatten(0, -2), y.flatten()).backward()
    expected = (
        torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item()
    )

    trainer = Trainer(make_model(), config(max_grad_norm=0.01), CPU)
    trainer.train_step([(x, y)])
    assert trainer.history[-1]["grad_norm"] == pytest.approx(expected, rel=1e-5)


def test_gradients_are_none_after_a_step():
    model = make_model()
    Trainer(model, config(), CPU).train_step([token_batch(4, seed=6)])
    assert all(p.grad is None for p in model.parameters())


def test_fp16_counts_as_skipped_exactly_the_steps_that_left_the_weights_alone():
    model = make_model()
    trainer = Trainer(model, config(precision="fp16", max_steps=5), CPU)
    unchanged = 0
    for i in range(5):
        before = copy.deepcopy(model.state_dict())
        trainer.train_step([token_batch(4, seed=30 + i)])
        unchanged += all(
            torch.equal(before[k], v) for k, v in model.state_dict().items()
        )
    trainer.log()
    assert trainer.scaler.is_enabled() and trainer.step >= 1
    assert trainer.skipped_steps == unchanged and trainer.step == 5 - unchanged
    assert all(math.isfinite(row["loss"]) for row in trainer.history)


class OverflowingLM(TinyLM):
    """TinyLM whose logits overflow fp16 (above 65,504) at any loss scale."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * 1e6


def test_a_forward_that_overflows_fp16_stops_with_a_clear_error():
    torch.manual_seed(0)
    trainer = Trainer(OverflowingLM(), config(precision="fp16"), CPU)
    with pytest.raises(NonFiniteLossError, match=r"fp16 overflows in the forward pass"):
        for i in range(MAX_SKIPS_IN_A_ROW + 1):
            trainer.train_step([token_batch(4, seed=i)])
    assert trainer.step == 0 and trainer.skipped_steps == MAX_SKIPS_IN_A_ROW


def test_fp16_inf_gradient_skips_the_step_and_halves_the_scale():
    model = make_model()
    trainer = Trainer(model, config(precision="fp16"), CPU)
    trainer.train_step([token_batch(4, seed=7)])  # one normal step first
    assert trainer.skipped_steps == 0, (
        "the first fp16 step overflowed; the test needs a clean step"
    )
    weights_before = copy.deepcopy(model.state_dict())
    scale_before = trainer.scaler.get_scale()
    steps_before = trainer.step

    hook = model.hidden.weight.register_hook(
        lambda grad: torch.full_like(grad, float("inf"))
    )
    trainer.train_step([token_batch(4, seed=8)])
    hook.remove()

    assert trainer.scaler.get_scale() == scale_before / 2, (
        "the scaler should halve its scale"
    )
    assert trainer.step == steps_before and trainer.skipped_steps == 1
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights_before[name]), (
            f"{name} changed in a skipped step"
        )


def test_add_val_loss_writes_the_pending_row_and_adds_the_validation_loss():
    model = make_model()
    trainer = Trainer(model, config(log_every=10), CPU)
    for i in range(3):
        trainer.train_step([token_batch(4, seed=60 + i)])
    assert trainer.history == [], "log_every=10: no row yet after 3 steps"
    validation = [token_batch(2, seed=50)]
    val_loss = trainer.add_val_loss(validation)
    assert [row["step"] for row in trainer.history] == [3]
    assert (
        trainer.history[-1]["val_loss"] == val_loss == evaluate(model, validation, CPU)
    )
    assert model.training, "add_val_loss must leave the model in training mode"


def test_add_val_loss_before_any_step_names_the_problem():
    trainer = Trainer(make_model(), config(), CPU)
    with pytest.raises(ValueError, match=r"add_val_loss: no step has been taken"):
        trainer.add_val_loss([token_batch(2, seed=50)])


class PoisonedLM(TinyLM):
    """TinyLM whose logits become NaN from its n-th training forward pass on."""

    def __init__(self, poison_at_call: int) -> None:
        super().__init__()
        self.poison_at_call, self.calls = poison_at_call, 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        logits = super().forward(idx)
        return logits * float("nan") if self.calls >= self.poison_at_call else logits


def test_a_loss_scale_that_reaches_zero_stops_instead_of_counting_steps():
    """At scale 0 the scale cannot drop further, so a skip no longer shows as a drop."""
    trainer = Trainer(make_model(), config(precision="fp16"), CPU)
    # the smallest float32 scale: gradients underflow, and a skip halves it to 0
    trainer.scaler.load_state_dict({**trainer.scaler.state_dict(), "scale": 2.0**-149})
    with pytest.raises(NonFiniteLossError, match=r"fp16 overflows .*loss scale 0\)"):
        for i in range(3):
            trainer.train_step([token_batch(4, seed=7 + i)])
    assert trainer.scaler.get_scale() == 0 and trainer.skipped_steps >= 1


def test_a_nan_step_is_recorded_on_the_device_and_no_state_after_it_is_saved():
    torch.manual_seed(0)
    model = PoisonedLM(poison_at_call=3)
    trainer = Trainer(model, config(log_every=100), CPU)
    for i in range(5):  # no error: the check does not wait for the device
        trainer.train_step([token_batch(4, seed=40 + i)])
    with pytest.raises(NonFiniteLossError, match=r"optimizer step 3\b"):
        trainer.state_dict()


def test_a_nan_gradient_under_a_finite_loss_is_noticed():
    model = make_model()
    trainer = Trainer(model, config(log_every=3), CPU)
    trainer.train_step([token_batch(4, seed=1)])
    hook = model.hidden.weight.register_hook(lambda grad: grad * float("nan"))
    result = trainer.train_step([token_batch(4, seed=2)])
    hook.remove()
    assert math.isfinite(result.loss.item()), "the test needs a finite loss"
    with pytest.raises(NonFiniteLossError, match=r"optimizer step 2\b"):
        trainer.train_step([token_batch(4, seed=3)])  # step 3 writes a row


def test_the_log_clock_stops_after_the_losses_are_read(monkeypatch):
    trainer = Trainer(make_model(), config(log_every=100), CPU)
    trainer.train_step([token_batch(4, seed=6)])
    events, tolist, clock = [], torch.Tensor.tolist, time.perf_counter
    monkeypatch.setattr(
        torch.Tensor, "tolist", lambda t: events.append("read") or tolist(t)
    )
    monkeypatch.setattr(time, "perf_counter", lambda: events.append("clock") or clock())
    trainer.log()
    assert "read" in events and events[-1] == "clock", events


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nan_loss_raises_an_error_naming_the_step(precision):
    torch.manual_seed(0)
    model = PoisonedLM(poison_at_call=3)
    # log_every=4: the loss is read at step 4, yet the error must name step 3.
    trainer = Trainer(model, config(precision=precision, log_every=4), CPU)
    with pytest.raises(NonFiniteLossError, match=r"optimizer step 3\b"):
        for i in range(10):
            trainer.train_step([token_batch(4, seed=40 + i)])


def run_short_training(seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    batches = [
        (
            torch.randint(0, VOCAB, (4, BLOCK), generator=generator),
            torch.randint(0, VOCAB, (4, BLOCK), generator=generator),
        )
        for _ in range(12)
    ]
    trainer = Trainer(make_model(seed), config(max_steps=6, accum_steps=2), CPU)
    for step in range(6):
        trainer.train_step(batches[2 * step : 2 * step + 2])
        if trainer.step % 3 == 0:
            trainer.add_val_loss(batches[:2])
    return trainer.history


def test_a_seeded_run_reproduces_its_loss_history_exactly():
    first, second = run_short_training(seed=9), run_short_training(seed=9)
    keys = ("step", "loss", "lr", "grad_norm", "val_loss")
    assert [[row.get(k) for k in keys] for row in first] == [
        [row.get(k) for k in keys] for row in second
    ]
    assert len(first) == 6 and "val_loss" in first[2] and "val_loss" in first[5]


def test_weight_decay_groups_split_by_dimension():
    model = make_model()
    decay, no_decay = Trainer(model, config(), CPU).optimizer.param_groups
    assert decay["weight_decay"] > 0 and no_decay["weight_decay"] == 0
    ids = lambda group: [id(p) for p in group["params"]]  # noqa: E731
    assert set(ids(decay)) == {id(p) for p in model.parameters() if p.dim() >= 2}
    assert set(ids(no_decay)) == {id(p) for p in model.parameters() if p.dim() < 2}
    everything = ids(decay) + ids(no_decay)
    assert len(everything) == len(set(everything)) == len(list(model.parameters()))


def test_tied_weight_appears_once():
    model = make_model()
    model.head.weight = model.embed.weight  # shapes agree: (VOCAB, WIDTH)
    decay, no_decay = Trainer(model, config(), CPU).optimizer.param_groups
    everything = [id(p) for p in decay["params"] + no_decay["params"]]
    assert everything.count(id(model.embed.weight)) == 1


def test_learning_rate_schedule_matches_warmup_then_cosine():
    settings = config(max_steps=50, warmup_steps=10, lr=1e-2, min_lr=1e-3)
    trainer = Trainer(make_model(), settings, CPU)
    used = []
    for step in range(settings.max_steps):
        trainer.train_step([token_batch(2, seed=step)])
        used.append(trainer.optimizer.param_groups[0]["lr"])  # the rate it stepped with
    # Independent statement of the schedule's landmarks.
    assert used[0] == pytest.approx(1e-2 / 10)  # first warmup step
    assert used[9] == pytest.approx(1e-2)  # end of warmup: the peak
    assert used[10] == pytest.approx(1e-2)  # start of the cosine: still the peak
    halfway = 10 + (50 - 10) // 2
    assert used[halfway] == pytest.approx((1e-2 + 1e-3) / 2)  # cos(pi/2) = 0
    assert used[49] == pytest.approx(
        1e-3 + 0.5 * (1 + math.cos(math.pi * 39 / 40)) * 9e-3
    )
    assert learning_rate(50, settings) == pytest.approx(1e-3)  # at max_steps: min_lr
    assert all(a < b for a, b in zip(used[:9], used[1:10], strict=True)), (
        "warmup must increase"
    )
    assert all(a > b for a, b in zip(used[10:-1], used[11:], strict=True)), (
        "cosine must decrease"
    )
    assert trainer.history[-1]["lr"] == pytest.approx(used[-1])


def test_model_on_another_device_is_refused_before_anything_is_built():
    model = make_model()
    with pytest.raises(
        ValueError, match=r"model tensor 'embed.weight' is on cpu, expected meta"
    ):
        Trainer(model, config(), torch.device("meta"))


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp8")


def test_zero_learning_rate_is_refused():
    with pytest.raises(ValueError, match=r"lr > 0, got min_lr=0.0, lr=0.0"):
        TrainConfig(lr=0.0, min_lr=0.0)


def test_evaluate_is_the_mean_over_target_tokens_and_restores_train_mode():
    x, y = token_batch(6, seed=11)
    y = y.clone()
    y[0] = IGNORE_INDEX
    model = make_model()
    expected = F.cross_entropy(model(x).flatten(0, -2), y.flatten()).item()
    model.train()
    got = evaluate(model, split(x, y, [1, 2, 3]), CPU)
    assert got == pytest.approx(expected, rel=1e-6)  # float32 summation order
    assert model.training


# -------------------------------------------------- the step's result, the optimizer


def test_train_step_returns_the_loss_norm_tokens_and_whether_it_skipped():
    x, y = token_batch(4, seed=12)
    y = y.clone()
    y[0, :2] = IGNORE_INDEX
    model = make_model()
    expected = F.cross_entropy(model(x).flatten(0, -2), y.flatten()).item()
    result = Trainer(model, config(), CPU).train_step([(x, y)])
    assert isinstance(result, StepResult) and result.skipped is False
    # float32 summation order
    assert result.loss.item() == pytest.approx(expected, rel=1e-6)
    assert result.target_tokens.item() == 4 * BLOCK - 2
    assert result.grad_norm.item() > 0


def test_skipped_fp16_step_is_reported_in_the_result():
    model = make_model()
    trainer = Trainer(model, config(precision="fp16"), CPU)
    hook = model.hidden.weight.register_hook(
        lambda grad: torch.full_like(grad, float("inf"))
    )
    result = trainer.train_step([token_batch(4, seed=8)])
    hook.remove()
    assert result.skipped is True and trainer.step == 0 and trainer.skipped_steps == 1


def test_build_optimizer_uses_the_fused_adamw_kernel_on_cpu():
    optimizer, scheduler = build_optimizer(make_model(), config(), CPU)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert all(group["fused"] for group in optimizer.param_groups)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(learning_rate(0, config()))
    assert scheduler.optimizer is optimizer


def test_a_passed_sgd_optimizer_is_the_one_that_steps():
    model = make_model()
    before = copy.deepcopy(model.state_dict())
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.ConstantLR(sgd, factor=1.0)
    trainer = Trainer(
        model, config(max_grad_norm=None), CPU, optimizer=sgd, scheduler=scheduler
    )
    x, y = token_batch(4, seed=13)
    reference = make_model()
    F.cross_entropy(reference(x).flatten(0, -2), y.flatten()).backward()
    trainer.train_step([(x, y)])
    for name, p in reference.named_parameters():
        # plain SGD: w - lr * grad, the same float32 operations up to summation order
        torch.testing.assert_close(
            model.state_dict()[name], before[name] - 0.5 * p.grad, rtol=1e-5, atol=1e-7
        )
    assert trainer.history[-1]["lr"] == 0.5


def test_bf16_autocast_trains_on_cpu_with_a_float32_loss_close_to_fp32():
    x, y = token_batch(8, seed=14)
    fp32 = Trainer(make_model(), config(), CPU).train_step([(x, y)])
    bf16_model = make_model()
    bf16_trainer = Trainer(bf16_model, config(precision="bf16"), CPU)
    bf16 = bf16_trainer.train_step([(x, y)])
    assert bf16.loss.dtype == torch.float32 and not bf16_trainer.scaler.is_enabled()
    assert bf16.skipped is False and bf16_trainer.step == 1
    # bf16 keeps 8 significant bits (relative rounding 2**-8 ~ 0.4%) in the matmuls;
    # the loss is float32 but computed from bf16 logits, so 2% covers several
    # roundings adding up.
    assert bf16.loss.item() == pytest.approx(fp32.loss.item(), rel=2e-2)
    assert bf16.loss.item() != fp32.loss.item(), (
        "autocast did not run the forward in bf16"
    )
    assert all(p.dtype == torch.float32 for p in bf16_model.parameters()), (
        "weights stay float32"
    )


# -------------------------------------------------- the trainer's state


def save_and_load(state: dict, tmp_path) -> dict:
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return torch.load(path, weights_only=True)


def train_steps(trainer: Trainer, first: int, last: int) -> None:
    for step in range(first, last):
        trainer.train_step([token_batch(4, seed=100 + step)])


def test_state_dict_round_trips_through_weights_only_and_continues_exactly(tmp_path):
    # 5 steps: one row at 3, steps 4-5 pending
    settings = config(max_steps=8, log_every=3)
    whole = Trainer(make_model(), settings, CPU)
    train_steps(whole, 0, 8)
    whole.log()

    first = Trainer(make_model(), settings, CPU)
    train_steps(first, 0, 5)
    state = save_and_load(first.state_dict(), tmp_path)
    assert state["step"] == 5 and [step["step"] for step in state["unlogged"]] == [4, 5]
    # different initial weights: all overwritten
    second = Trainer(make_model(seed=1), settings, CPU)
    second.load_state_dict(state)
    train_steps(second, 5, 8)
    second.log()
    assert (
        [row["step"] for row in second.history]
        == [row["step"] for row in whole.history]
        == [3, 6, 8]
    )
    # exact float equality: same process, same operations in the same order
    assert [row["loss"] for row in second.history] == [
        row["loss"] for row in whole.history
    ]
    assert [row["lr"] for row in second.history] == [row["lr"] for row in whole.history]
    for name, tensor in whole.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[name], tensor), name


def test_resume_with_a_changed_learning_rate_uses_and_logs_the_new_schedule(tmp_path):
    old = config(max_steps=10, lr=1e-2, min_lr=1e-3, warmup_steps=2)
    new = config(max_steps=10, lr=4e-3, min_lr=1e-4, warmup_steps=2)
    first = Trainer(make_model(), old, CPU)
    train_steps(first, 0, 5)
    resumed = Trainer(make_model(), new, CPU)
    resumed.load_state_dict(save_and_load(first.state_dict(), tmp_path))
    used = []
    for step in range(5, 8):
        train_steps(resumed, step, step + 1)
        # what the optimizer really stepped with
        used.append(resumed.optimizer.param_groups[0]["lr"])
    logged = [row["lr"] for row in resumed.history[-3:]]
    assert logged == used, "the history must log the rate the optimizer used"
    assert used == pytest.approx([learning_rate(step, new) for step in range(5, 8)])
    assert used[0] != pytest.approx(learning_rate(5, old)), (
        "the old schedule is still in use"
    )


def test_resume_with_the_same_config_keeps_the_loaded_rate_bit_for_bit(tmp_path):
    settings = config(max_steps=10, warmup_steps=3)
    first = Trainer(make_model(), settings, CPU)
    train_steps(first, 0, 4)
    rate = first.optimizer.param_groups[0]["lr"]
    resumed = Trainer(make_model(), settings, CPU)
    resumed.load_state_dict(save_and_load(first.state_dict(), tmp_path))
    assert resumed.optimizer.param_groups[0]["lr"] == rate


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda s: s.pop("step"), r"expected a dict of model, optimizer"),
        (lambda s: s.update(extra=1), r"expected a dict of model, .*'extra'"),
        (lambda s: s.update(step=-1), r"step: -1, expected an int"),
        (lambda s: s.update(step=True), r"step: True, expected an int"),
        (lambda s: s.update(history=None), r"history, unlogged.*NoneType"),
        (lambda s: s.update(config="lr=0.1"), r"history, unlogged.*config: dictionary"),
        (
            lambda s: s.update(optimizer=None),
            r"optimizer: expected a dict with 'state'",
        ),
        (lambda s: s["model"].pop("head.bias"), r"model: 1 missing keys: head.bias"),
        (
            lambda s: s["model"].update({"head.weight": torch.zeros(2, 2)}),
            r"model: head.weight: torch.float32 \(2, 2\)",
        ),
        (
            lambda s: s["optimizer"]["param_groups"][0].update(amsgrad=True),
            r"amsgrad=True in the state, False here",
        ),
        (lambda s: s["unlogged"][0].pop("loss"), r"history, unlogged.*'loss'"),
        (
            lambda s: s.update(scaler={"scale": 1.0}),
            r"scaler: keys \['scale'\] in the state, \[\] here",
        ),
        (
            lambda s: s.update(scheduler={"x": 1}),
            r"scheduler: True in the state, False",
        ),
        (lambda s: s.update(model=None), r"model: a NoneType, expected a dict"),
        (lambda s: s.update(model=list(s["model"])), r"model: a list, expected a dict"),
        (
            lambda s: s["optimizer"]["param_groups"].__setitem__(0, "decay"),
            r"optimizer: not an optimizer.state_dict\(\): TypeError",
        ),
        (
            lambda s: s["optimizer"]["param_groups"][1].pop("params"),
            r"optimizer: not an optimizer.state_dict\(\): KeyError\('params'\)",
        ),
        (
            lambda s: s["optimizer"]["state"].__setitem__(0, [1.0]),
            r"optimizer state of parameter 0: a list, expected a dict",
        ),
    ],
    ids=[
        "no-step",
        "extra-key",
        "negative-step",
        "bool-step",
        "history-none",
        "config-a-string",
        "no-optimizer",
        "missing-key",
        "wrong-shape",
        "amsgrad-switched",
        "unlogged-step-without-loss",
        "scaler-on",
        "scheduler-on",
        "model-none",
        "model-a-list",
        "group-a-string",
        "group-without-params",
        "entry-a-list",
    ],
)
def test_a_bad_state_is_refused_and_nothing_changes(damage, message):
    source = Trainer(make_model(seed=1), config(log_every=4), CPU)
    train_steps(source, 0, 2)
    state = source.state_dict()
    damage(state)
    target = Trainer(make_model(), config(log_every=4), CPU)
    weights = copy.deepcopy(target.model.state_dict())
    optimizer_state = copy.deepcopy(target.optimizer.state_dict())
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(state)
    assert target.step == 0 and not target._unlogged and target.history == []
    assert all(torch.equal(target.model.state_dict()[k], v) for k, v in weights.items())
    assert target.optimizer.state_dict() == optimizer_state


def same_tensors(a, b) -> bool:
    """Whether two nested dicts and lists hold equal values and equal tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(same_tensors, a, b))
    return a == b


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda entry: entry.update(step="3"),
            r"optimizer state of parameter 0: 'step' is a str, expected a tensor",
        ),
        (
            lambda entry: entry.update(exp_avg=entry["exp_avg"].tolist()),
            r"optimizer state of parameter 0: 'exp_avg' is a list, expected a tensor",
        ),
        (
            lambda entry: entry.pop("exp_avg"),
            r"optimizer state of parameter 0: lacks \['exp_avg'\], which other "
            r"parameters of group 0 hold",
        ),
        (
            lambda entry: entry.pop("step"),
            r"optimizer state of parameter 0: lacks \['step'\]",
        ),
    ],
    ids=["step-a-string", "moment-a-list", "moment-missing", "step-missing"],
)
def test_a_malformed_optimizer_entry_changes_neither_trainer_nor_optimizer(
    damage, message
):
    """A state that torch would load, or load half-way, and fail on later."""
    source = Trainer(make_model(seed=1), config(log_every=4), CPU)
    train_steps(source, 0, 2)
    state = copy.deepcopy(source.state_dict())
    damage(state["optimizer"]["state"][0])
    target = Trainer(make_model(), config(log_every=4), CPU)
    train_steps(target, 0, 1)  # the optimizer has moments to lose
    weights = copy.deepcopy(target.model.state_dict())
    optimizer_state = copy.deepcopy(target.optimizer.state_dict())
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(state)
    assert target.step == 1
    assert same_tensors(target.model.state_dict(), weights)
    assert same_tensors(target.optimizer.state_dict(), optimizer_state)
    train_steps(target, 1, 2)  # and it trains on
    assert target.step == 2


def test_an_optimizer_state_for_a_parameter_the_model_lacks_is_refused():
    """Torch keeps such an entry and saves it again with every later state."""
    source = Trainer(make_model(seed=1), config(log_every=4), CPU)
    train_steps(source, 0, 2)
    state = copy.deepcopy(source.state_dict())
    count = sum(len(group["params"]) for group in state["optimizer"]["param_groups"])
    state["optimizer"]["state"][count] = dict(state["optimizer"]["state"][0])
    target = Trainer(make_model(), config(log_every=4), CPU)
    train_steps(target, 0, 1)
    optimizer_state = copy.deepcopy(target.optimizer.state_dict())
    with pytest.raises(
        ValueError,
        match=rf"optimizer state of parameter {count}: no such parameter; the "
        rf"state's groups list {count} parameters",
    ):
        target.load_state_dict(state)
    assert same_tensors(target.optimizer.state_dict(), optimizer_state)
    assert sorted(target.state_dict()["optimizer"]["state"]) == list(range(count))


def test_reloading_the_state_before_a_nan_step_trains_on_as_if_it_never_happened():
    """The recovery the NaN error advises: load a state from before it, train on."""
    reference = Trainer(make_model(), config(), CPU)
    train_steps(reference, 0, 2)
    trainer = Trainer(make_model(), config(), CPU)
    train_steps(trainer, 0, 1)
    good = copy.deepcopy(trainer.state_dict())  # live tensors: keep a copy
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.fill_(float("nan"))
    with pytest.raises(NonFiniteLossError, match=r"optimizer step 2\b"):
        train_steps(trainer, 1, 2)
    trainer.load_state_dict(good)
    train_steps(trainer, 1, 2)  # the same batch as the reference's step 2
    # exact float equality: the same operations in the same order in one process
    # (tokens_per_second, a timing, is left out)
    for key in ("step", "loss", "lr", "grad_norm"):
        assert trainer.history[-1][key] == reference.history[-1][key], key
    for name, tensor in reference.model.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], tensor), name


def test_the_fp16_skips_in_a_row_are_the_loaded_states():
    """A state carries its count of skips in a row; loading it replaces the live one.

    A run that overflows fp16 at every step stops at its MAX_SKIPS_IN_A_ROW-th skip
    in a row, counted across a save and a load as in one run.
    """
    torch.manual_seed(0)
    source = Trainer(OverflowingLM(), config(precision="fp16"), CPU)
    already = MAX_SKIPS_IN_A_ROW // 3
    train_steps(source, 0, already)
    torch.manual_seed(0)
    target = Trainer(OverflowingLM(), config(precision="fp16"), CPU)
    train_steps(target, 0, MAX_SKIPS_IN_A_ROW - 1)  # one skip short of the error
    target.load_state_dict(source.state_dict())
    skips = 0
    with pytest.raises(NonFiniteLossError, match=r"fp16 overflows in the forward"):
        while skips <= MAX_SKIPS_IN_A_ROW:
            skips += 1
            train_steps(target, 0, 1)
    assert skips == MAX_SKIPS_IN_A_ROW - already
    assert target.step == 0


def test_a_scaler_state_with_missing_fields_is_refused_before_the_model_changes():
    source = Trainer(make_model(seed=1), config(precision="fp16"), CPU)
    train_steps(source, 0, 1)
    state = {**source.state_dict(), "scaler": {"scale": 1.0}}
    target = Trainer(make_model(), config(precision="fp16"), CPU)
    weights = copy.deepcopy(target.model.state_dict())
    with pytest.raises(ValueError, match=r"scaler: keys \['scale'\] in the state, \['"):
        target.load_state_dict(state)
    assert all(torch.equal(target.model.state_dict()[k], v) for k, v in weights.items())


def test_a_step_without_the_fp16_scaler_never_reads_the_scale(monkeypatch):
    """Reading the scale is a host sync; fp32 and bf16 steps must not pay it."""
    trainer = Trainer(make_model(), config(precision="bf16", log_every=100), CPU)

    def sync(*args):
        raise AssertionError(
            "get_scale() called without the fp16 scaler: a host sync for nothing"
        )

    monkeypatch.setattr(trainer.scaler, "get_scale", sync)
    trainer.train_step([token_batch(4, seed=6)])
    assert trainer.step == 1


# -------------------------------------------------- two ranks (gloo, in subprocesses)

DDP_WORKER = r"""
import os, sys, torch, torch.distributed as dist
from torch import nn
from torchbook.train import Trainer, TrainConfig

def worker(rank, port, out):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 16), nn.Linear(16, 11))
    ddp = nn.parallel.DistributedDataParallel(model)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.5)
    config = TrainConfig(
        max_steps=1, warmup_steps=0, max_grad_norm=None, accum_steps=2, log_every=1
    )
    constant = torch.optim.lr_scheduler.ConstantLR(sgd, factor=1.0)
    trainer = Trainer(ddp, config, "cpu", optimizer=sgd, scheduler=constant)
    x, y = torch.load(out + "/data.pt")
    mine = slice(4 * rank, 4 * rank + 4)
    micro = [(x[mine][:2], y[mine][:2]), (x[mine][2:], y[mine][2:])]
    result = trainer.train_step(micro)
    if rank == 0:
        saved = {
            "weights": model.state_dict(),
            "loss": result.loss,
            "tokens": result.target_tokens,
        }
        torch.save(saved, out + "/rank0.pt")
    dist.barrier()
    dist.destroy_process_group()
    # gloo's threads outlive destroy_process_group (torch 2.14) and now and then
    # abort a normal exit (SIGABRT); examples/train_ddp.py has the details. Leave
    # without that teardown.
    os._exit(0)

if __name__ == "__main__":
    torch.multiprocessing.spawn(worker, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
"""


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_ddp_ranks_with_uneven_tokens_take_the_one_process_step(tmp_path):
    """Two ranks with uneven tokens take the single-process step.

    The global token count, loss x world_size and no_sync together give its gradient.
    """
    import subprocess
    import sys

    generator = torch.Generator().manual_seed(3)
    x = torch.randint(0, 11, (8, 5), generator=generator)
    y = torch.randint(0, 11, (8, 5), generator=generator)
    # rank 0's first micro-batch is mostly ignored; rank 1 has all its tokens
    y[:2, :4] = IGNORE_INDEX
    torch.save((x, y), tmp_path / "data.pt")
    script = tmp_path / "ddp_worker.py"
    script.write_text(DDP_WORKER)
    done = subprocess.run(
        [sys.executable, str(script), str(free_port()), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = torch.load(tmp_path / "rank0.pt", weights_only=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 16), nn.Linear(16, 11))
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    single = Trainer(
        model,
        TrainConfig(max_steps=1, warmup_steps=0, max_grad_norm=None),
        CPU,
        optimizer=sgd,
        scheduler=torch.optim.lr_scheduler.ConstantLR(sgd, factor=1.0),
    )
    result = single.train_step([(x, y)])
    assert ranks["tokens"].item() == result.target_tokens.item() == 8 * 5 - 8
    # float32 sums in another order (by rank, then across): a few ulps; 1e-5 has margin
    torch.testing.assert_close(ranks["loss"], result.loss, rtol=1e-5, atol=1e-7)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(
            ranks["weights"][name], tensor, rtol=1e-5, atol=1e-6, msg=name
        )
