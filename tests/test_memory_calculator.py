"""The calculator's command line: python -m torchbook.memory."""

from __future__ import annotations

import json
import re

import pytest

from torchbook.memory.calculator import NOT_COUNTED, main
from torchbook.memory.configs import architecture
from torchbook.memory.peak import predict
from torchbook.memory.step import Setup

LLAMA = {
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0},
}


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA), encoding="utf-8")
    return str(path)


def run(arguments: list[str], capsys) -> str:
    assert main(arguments) == 0
    return capsys.readouterr().out


def test_the_json_report_holds_the_prediction_row_by_row(config, capsys):
    out = run(["--config", config, "--batch", "2", "--seq", "64", "--json"], capsys)
    report = json.loads(out)
    prediction = predict(architecture(LLAMA), Setup(2, 64))
    assert report["peak_bytes"] == prediction.peak
    assert report["peak_moment"] == prediction.peak_moment
    assert report["bytes"]["optimizer states"] == prediction.optimizer_states
    assert report["bytes"]["activations: blocks"] == prediction.activations["blocks"]
    assert report["not_counted"] == list(NOT_COUNTED)
    assert any("SDPA" in line for line in report["assumptions"])


def test_each_row_is_printed_in_bytes_and_gb_and_the_fit_comes_last(config, capsys):
    out = run(["--config", config, "--gpu-gb", "1e-3"], capsys)
    peak = predict(architecture(LLAMA), Setup(8, 1024)).peak
    assert f"{peak:>18,}{peak / 1e9:>10.3f}" in out
    assert out.strip().splitlines()[-1].startswith("fits in 0.001 GB")
    assert "no, " in out.strip().splitlines()[-1]
    assert "not counted: the CUDA context (unmeasured)" in out


def test_flags_override_the_config(config, capsys):
    out = run(["--config", config, "--layers", "4", "--json"], capsys)
    four = predict(architecture({**LLAMA, "num_hidden_layers": 4}), Setup(8, 1024))
    assert json.loads(out)["peak_bytes"] == four.peak


def test_every_option_shows_its_default_in_help(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    # each option's help text, up to the next option: every one names a default
    # (or is a switch, off unless given)
    options = re.split(r"\n\s+(?=--)", out.split("the model:", 1)[1])
    for option in options[1:]:
        name = option.split()[0]
        if name in ("--bucket-view", "--no-reshard-after-forward", "--json"):
            continue
        assert "default" in option or re.search(r"\(\d", option), name
    assert "rows per micro-batch, per rank" in out


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--ranks", "8"], "ranks=8 with parallel='none'"),
        (["--bucket-view"], "bucket_view is DDP's"),
        (["--lora-rank", "4"], "--lora-rank needs --trains lora"),
        (["--loop", "tutorial"], "--loop tutorial is the book's GPT's"),
        (["--trains", "lora", "--lora-targets", "c_fc"], "not llama projections"),
        (["--parallel", "fsdp", "--ranks", "2", "--loss-chunks", "2"], "chunked loss"),
        (["--gpu-gb", "0"], "--gpu-gb must be > 0"),
        (["--trains", "frozen"], "a frozen model has no optimizer"),
    ],
)
def test_meaningless_flags_are_refused_by_name(config, arguments, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--config", config, *arguments])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unknown_family_is_refused_with_the_known_ones(tmp_path, capsys):
    path = tmp_path / "falcon.json"
    path.write_text(json.dumps({"model_type": "falcon"}), encoding="utf-8")
    with pytest.raises(SystemExit):
        main(["--config", str(path)])
    error = capsys.readouterr().err
    assert "model_type 'falcon' is not one the calculator knows" in error
    assert "llama, mistral, qwen2, gpt2" in error


def test_a_config_file_that_is_missing_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--config", str(tmp_path / "nowhere.json")])
    assert "nowhere.json: no such file" in capsys.readouterr().err


def test_a_lora_row_trains_only_the_adapters(config, capsys):
    report = json.loads(
        run(
            ["--config", config, "--trains", "lora", "--lora-rank", "4", "--json"],
            capsys,
        )
    )
    # q_proj (128 -> 128) and v_proj (128 -> 32), rank 4, two layers, float32
    adapters = 2 * 4 * ((128 + 128) + (128 + 32))
    assert report["bytes"]["gradients"] == 4 * adapters
    assert f"{adapters:,} training" in report["model"]
