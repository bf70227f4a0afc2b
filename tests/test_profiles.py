"""The one place that picks device and sizes from QUARTO_PROFILE; the device helpers."""

from __future__ import annotations

import time

import pytest
import torch

from torchbook.book import profiles as profile
from torchbook.device import timed


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "cpu"),
        ("", "cpu"),
        ("cpu", "cpu"),
        ("gpu", "gpu"),
        ("draft,gpu", "gpu"),
        (" gpu , draft ", "gpu"),
    ],
)
def test_profile_name_is_read_from_a_comma_separated_list(value, expected):
    assert profile.parse_profile(value) == expected


def test_asking_for_both_profiles_is_an_error():
    with pytest.raises(profile.ProfileError, match="names both 'cpu' and 'gpu'"):
        profile.parse_profile("cpu,gpu")


def test_default_profile_is_cpu_in_float32(monkeypatch):
    monkeypatch.delenv(profile.PROFILE_VARIABLE, raising=False)
    active = profile.active_profile()
    assert active.name == "cpu"
    assert active.device == torch.device("cpu")
    assert active.precision == "fp32"


def test_gpu_profile_without_accelerator_stops_with_a_clear_message(monkeypatch):
    monkeypatch.setenv(profile.PROFILE_VARIABLE, "gpu")
    monkeypatch.setattr(profile, "accelerator", lambda: None)
    with pytest.raises(
        profile.ProfileError, match="needs CUDA or MPS, and this machine has neither"
    ):
        profile.active_profile()


def test_gpu_profile_uses_the_accelerator_in_bf16(monkeypatch):
    monkeypatch.setenv(profile.PROFILE_VARIABLE, "gpu")
    monkeypatch.setattr(profile, "accelerator", lambda: torch.device("cuda"))
    active = profile.active_profile()
    assert active.device == torch.device("cuda")
    assert active.precision == "bf16"


def test_timed_returns_the_result_and_the_seconds_the_work_took():
    calls = []

    def work() -> int:
        calls.append(time.perf_counter())
        time.sleep(0.05)
        return 7

    before = time.perf_counter()
    result, seconds = timed(work, torch.device("cpu"))
    after = time.perf_counter()
    # the clock runs around the work alone: at least its sleep, at most the whole call
    assert result == 7 and len(calls) == 1
    assert 0.05 <= seconds <= after - before
