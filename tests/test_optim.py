"""The book's optimizer, its schedule, and the layout check before a state is loaded."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from torchbook.optim import (
    OptimizerConfig,
    apply_config,
    build_adamw,
    build_optimizer,
    learning_rate,
    load_optimizer_state,
    optimizer_state_problems,
    parameter_groups,
    set_learning_rate,
)


def stepped(
    config: OptimizerConfig, steps: int = 3
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """A small model whose book optimizer took ``steps`` steps (so it has moments)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    optimizer, scheduler = build_optimizer(model, config, torch.device("cpu"))
    for _ in range(steps):
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, scheduler


def test_an_optimizer_config_names_the_field_that_is_wrong():
    with pytest.raises(
        ValueError,
        match=r"OptimizerConfig.warmup_steps must be an int in \[0, max_steps=10\]",
    ):
        OptimizerConfig(max_steps=10, warmup_steps=11)
    with pytest.raises(ValueError, match=r"min_lr=0.1, lr=0.01"):
        OptimizerConfig(lr=0.01, min_lr=0.1)


def test_a_saved_state_of_the_same_optimizer_has_no_problems():
    _, optimizer, _ = stepped(OptimizerConfig(max_steps=10, warmup_steps=2))
    assert (
        optimizer_state_problems(copy.deepcopy(optimizer.state_dict()), optimizer) == []
    )


def test_a_scalar_parameter_whose_moments_are_0_dim_is_not_refused():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.temperature = (
                nn.Linear(4, 2),
                nn.Parameter(torch.tensor(1.0)),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) / self.temperature

    model = Scaled()
    optimizer, _ = build_optimizer(
        model, OptimizerConfig(max_steps=10, warmup_steps=2), torch.device("cpu")
    )
    model(torch.randn(5, 4)).square().mean().backward()
    optimizer.step()
    # a moment and a step count look alike here
    assert optimizer.state[model.temperature]["exp_avg"].dim() == 0
    assert (
        optimizer_state_problems(copy.deepcopy(optimizer.state_dict()), optimizer) == []
    )


def test_amsgrad_switched_on_is_refused_though_torch_loads_it_and_then_fails():
    model, optimizer, _ = stepped(OptimizerConfig(max_steps=10, warmup_steps=2))
    saved = copy.deepcopy(optimizer.state_dict())
    saved["param_groups"][0]["amsgrad"] = True
    assert optimizer_state_problems(saved, optimizer) == [
        "optimizer group 0: amsgrad=True in the state, False here"
    ]
    # independent check that the refusal matters: torch loads it, the next step fails
    optimizer.load_state_dict(saved)
    model(torch.randn(5, 4)).square().mean().backward()
    with pytest.raises((RuntimeError, KeyError)):
        optimizer.step()


def test_a_moment_of_another_shape_is_refused_though_torch_loads_it():
    _, optimizer, _ = stepped(OptimizerConfig(max_steps=10, warmup_steps=2))
    saved = copy.deepcopy(optimizer.state_dict())
    saved["state"][0]["exp_avg"] = torch.zeros(3)
    assert optimizer_state_problems(saved, optimizer) == [
        "optimizer state of parameter 0: 'exp_avg' has shape (3,), the parameter (8, 4)"
    ]
    # torch loads it without a word. Not stepped here: the fused kernel then writes
    # past the moment's 3 floats (seen once as glibc's "free(): invalid next size" as
    # the process ended).
    optimizer.load_state_dict(saved)
    assert optimizer.state_dict()["state"][0]["exp_avg"].shape == (3,)


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda s: s["param_groups"].pop(),
            r"optimizer: 1 parameter groups in the state, 2 here",
        ),
        (
            lambda s: s["param_groups"][0]["params"].pop(),
            r"optimizer group 0: 1 parameters in the state, 2 here",
        ),
        (lambda s: s.pop("state"), r"optimizer: expected a dict with 'state'"),
    ],
    ids=["one-group", "group-of-another-size", "no-state"],
)
def test_another_group_layout_is_named(damage, message):
    _, optimizer, _ = stepped(OptimizerConfig(max_steps=10, warmup_steps=2))
    saved = copy.deepcopy(optimizer.state_dict())
    damage(saved)
    problems = optimizer_state_problems(saved, optimizer)
    assert any(re.search(message, line) for line in problems), problems


def test_a_state_saved_without_the_fused_kernel_loads_into_a_fused_optimizer():
    config = OptimizerConfig(max_steps=10, warmup_steps=2)
    model, _, _ = stepped(config, steps=0)
    unfused = torch.optim.AdamW(
        parameter_groups(model, config.weight_decay), lr=config.lr, betas=config.betas
    )
    model(torch.randn(5, 4)).square().mean().backward()
    unfused.step()
    saved = copy.deepcopy(unfused.state_dict())
    assert saved["param_groups"][0]["fused"] is None

    def scaled_step(optimizer: torch.optim.Optimizer) -> None:
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(model(torch.randn(5, 4)).square().mean()).backward()
        scaler.step(optimizer)

    as_torch_loads_it, _ = build_optimizer(model, config, torch.device("cpu"))
    as_torch_loads_it.load_state_dict(copy.deepcopy(saved))
    # torch took fused=None from the file; the scaler still sees a fused optimizer
    with pytest.raises(AssertionError):
        scaled_step(as_torch_loads_it)
    fused, _ = build_optimizer(model, config, torch.device("cpu"))
    assert optimizer_state_problems(saved, fused) == []
    load_optimizer_state(fused, saved)
    assert all(group["fused"] is True for group in fused.param_groups)
    scaled_step(fused)
    assert int(fused.state_dict()["state"][0]["step"]) == 2


def test_set_learning_rate_writes_the_schedule_into_every_group():
    config = OptimizerConfig(max_steps=10, lr=1e-2, min_lr=1e-3, warmup_steps=2)
    model, optimizer, _ = stepped(config, steps=0)
    for step in (0, 1, 2, 6, 10, 12):
        rate = set_learning_rate(optimizer, step, config)
        assert [group["lr"] for group in optimizer.param_groups] == [rate, rate]
    # independent landmarks: warmup 1/2 of lr, the peak, mid-cosine, min_lr after
    assert set_learning_rate(optimizer, 0, config) == pytest.approx(0.5e-2)
    assert set_learning_rate(optimizer, 2, config) == pytest.approx(1e-2)
    assert set_learning_rate(optimizer, 6, config) == pytest.approx((1e-2 + 1e-3) / 2)
    assert set_learning_rate(optimizer, 12, config) == pytest.approx(1e-3)


def test_a_loaded_optimizer_takes_the_betas_and_decay_of_a_new_config():
    config = OptimizerConfig(max_steps=10, warmup_steps=2, betas=(0.9, 0.95))
    model, optimizer, _ = stepped(config, steps=2)
    changed = OptimizerConfig(
        max_steps=10, warmup_steps=2, weight_decay=0.01, betas=(0.8, 0.9)
    )
    resumed = build_adamw(model, changed, torch.device("cpu"))
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert resumed.param_groups[0]["betas"] == (0.9, 0.95), "loading restores the old"
    apply_config(resumed, changed)
    assert [(g["betas"], g["weight_decay"]) for g in resumed.param_groups] == [
        ((0.8, 0.9), 0.01),
        ((0.8, 0.9), 0.0),
    ]


def test_build_optimizer_for_a_hand_written_loop_follows_learning_rate():
    config = OptimizerConfig(max_steps=10, lr=1e-2, min_lr=1e-3, warmup_steps=2)
    _, optimizer, scheduler = stepped(config, steps=0)
    for step in range(12):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(
            learning_rate(step, config), rel=1e-12
        )
        optimizer.step()
        scheduler.step()
