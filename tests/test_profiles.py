"""The one place that picks the device and sizes from QUARTO_PROFILE."""

from __future__ import annotations

import pytest
import torch

from torchbook import profiles as profile


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
    assert active.autocast_dtype is None


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
    assert active.autocast_dtype is torch.bfloat16
