"""The calculator's command line: python -m torchbook.memory."""

from __future__ import annotations

import json
import re

import pytest

from torchbook.memory import TrainingSetup
from torchbook.memory.calculator import NOT_COUNTED, estimate, main
from torchbook.memory.configs import architecture
from torchbook.memory.fit import GIB
from torchbook.memory.peak import predict

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
    prediction = predict(architecture(LLAMA), TrainingSetup(2, 64, precision="bf16"))
    assert report["peak_bytes"] == prediction.peak
    assert report["peak_instant"] == prediction.peak_instant
    assert report["bytes"]["optimizer_states"] == prediction.optimizer_states
    assert report["activations"]["blocks"] == prediction.activations["blocks"]
    assert report["not_counted"] == list(NOT_COUNTED)
    assert any("SDPA" in line for line in report["assumptions"])


def test_each_row_is_printed_in_bytes_and_gb_and_the_fit_comes_last(config, capsys):
    out = run(["--config", config, "--gpu-gib", "1e-3"], capsys)
    peak = predict(architecture(LLAMA), TrainingSetup(8, 1024, precision="bf16")).peak
    assert f"{peak:>18,}{peak / GIB:>10.3f}" in out
    assert out.strip().splitlines()[-1].startswith("fits a 0.001 GiB GPU")
    assert ": no, " in out.strip().splitlines()[-1]
    assert "not counted: the CUDA context (unmeasured)" in out


def test_flags_override_the_config(config, capsys):
    out = run(["--config", config, "--layers", "4", "--json"], capsys)
    four = predict(
        architecture({**LLAMA, "num_hidden_layers": 4}),
        TrainingSetup(8, 1024, precision="bf16"),
    )
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
        if name in (
            "--gradient-as-bucket-view",
            "--no-reshard-after-forward",
            "--json",
        ):
            continue
        assert "default" in option or re.search(r"\(\d", option), name
    assert "rows per micro-batch, per rank" in out


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--ranks", "8"], "ranks=8 with parallel='none'"),
        (["--gradient-as-bucket-view"], "gradient_as_bucket_view is DDP's"),
        (["--lora-rank", "4"], "--lora-rank needs --trains lora"),
        (["--loop", "tutorial"], "the tutorial loop is the book's GPT's"),
        (["--trains", "lora", "--lora-targets", "c_fc"], "not llama projections"),
        (["--parallel", "fsdp", "--ranks", "2", "--loss-chunks", "2"], "chunked loss"),
        (["--gpu-gib", "0"], "--gpu-gib must be > 0"),
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
    assert f"{adapters:,} training" in report["title"]


def bad_config(tmp_path, **changes) -> str:
    path = tmp_path / "bad" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({**LLAMA, **changes}), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"hidden_size": "896"}, "hidden_size"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"intermediate_size": 344.5}, "intermediate_size"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"attention_dropout": "0.1"}, "attention_dropout"),
        ({"head_dim": 0}, "head_dim"),
    ],
)
def test_a_bad_field_ends_in_one_message_naming_file_and_field(
    tmp_path, changes, field, capsys
):
    path = bad_config(tmp_path, **changes)
    with pytest.raises(SystemExit) as exit:
        main(["--config", path])
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{path}: {field}" in error, error


def test_a_bad_config_leaves_no_traceback_from_the_command_line(tmp_path):
    import subprocess
    import sys

    path = bad_config(tmp_path, num_attention_heads=0)
    run = subprocess.run(
        [sys.executable, "-m", "torchbook.memory", "--config", path],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert f"{path}: num_attention_heads" in run.stderr


def test_an_unknown_familys_message_begins_with_the_file(tmp_path, capsys):
    path = tmp_path / "falcon" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"model_type": "falcon"}), encoding="utf-8")
    with pytest.raises(SystemExit):
        main(["--config", str(path)])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.split("error: ", 1)[1].startswith(f"{path}: model_type 'falcon'")


def test_the_json_report_holds_integer_parameter_counts(config, capsys):
    report = json.loads(run(["--config", config, "--trains", "lora", "--json"], capsys))
    arch = architecture(LLAMA)
    assert report["parameters"] == arch.parameter_count()
    assert isinstance(report["parameters"], int)
    # peft's default targets q_proj (128 -> 128) and v_proj (128 -> 32), rank 8
    assert report["trainable_parameters"] == 2 * 8 * ((128 + 128) + (128 + 32))
    assert all(isinstance(value, int) for value in report["bytes"].values())
    assert isinstance(report["peak_bytes"], int)


def test_a_4_bit_base_is_reported_by_storage_in_the_json(config, capsys):
    from torchbook.memory.step import parameter_bytes

    report = json.loads(
        run(["--config", config, "--trains", "lora", "--base", "nf4", "--json"], capsys)
    )
    setup = TrainingSetup(8, 1024, "bf16", trains="lora", base="nf4")
    stored = parameter_bytes(architecture(LLAMA), setup)
    assert report["parameter_bytes"] == stored
    assert report["bytes"]["parameters"] == sum(stored.values())
    assert report["peak_bytes"] == predict(architecture(LLAMA), setup).peak


def test_a_4_bit_base_without_lora_is_refused_by_name(config, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--config", config, "--base", "nf4"])
    assert exit.value.code == 2
    assert "base='nf4' is QLoRA's frozen base" in capsys.readouterr().err


def test_estimate_returns_what_json_prints(tmp_path, capsys):
    # Scripts and notebooks read the report as a dict; it must be --json's, key for key.
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
    flags = ["--config", str(config), "--trains", "lora", "--batch", "2"]
    main([*flags, "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert estimate(flags) == printed
    assert isinstance(printed["trainable_parameters"], int)


def test_estimate_raises_on_a_bad_field_and_prints_nothing(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"model_type": "llama", "num_attention_heads": 0}), encoding="utf-8"
    )
    with pytest.raises(ValueError, match="config.json"):
        estimate(["--config", str(config)])
    assert capsys.readouterr().out == ""
