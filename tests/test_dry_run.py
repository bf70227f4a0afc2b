"""The GPU dry run: the job's own run functions on fake tensors, and what it measures.

The script is run as a program (``python examples/gpu_results.py --dry-run``),
never imported. Its memory is checked against the CPU's allocator on the same
step: the fake peak is a lower bound, short by what one kernel allocates and
frees inside itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch._C._profiler import _EventType
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from torchbook.book.dry_run import (
    SWITCHED,
    DryRunError,
    fake_peak_bytes,
    fake_run,
    gpt_step,
    gpu_steps,
)
from torchbook.book.profiles import gpu_profile
from torchbook.book.results import find_results, read_result
from torchbook.memory.measure import training_step
from torchbook.memory.tracker import fake_step_peak
from torchbook.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "gpu_results.py"
SMALL = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, d_model=32)
DRY_RUN_TIMEOUT_S = 300


def test_a_gpt_step_runs_forward_and_backward_on_fake_cpu_tensors():
    # GPT.forward's token-id check reads values; fake tensors have none to read.
    with fake_run():
        model = GPT(SMALL)
        idx = torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size))
        model(idx).float().sum().backward()
        shapes = [(p.grad.shape, p.shape) for p in model.parameters()]
    assert all(grad == shape for grad, shape in shapes)


def test_real_cpu_ids_outside_the_vocabulary_are_still_refused():
    idx = torch.tensor([[1, SMALL.vocab_size]])
    with pytest.raises(ValueError, match="GPT.forward: idx holds token id 64"):
        GPT(SMALL)(idx)


def test_values_from_data_and_counters_are_real_and_the_models_are_placeholders():
    with fake_run() as mode:
        data = torch.tensor([1.0, 2.0, 3.0])  # read from disk: real
        count = torch.zeros((), dtype=torch.int64)
        count += 5
        model = torch.nn.Linear(3, 1)
        output = model(data).sum()
        from_data, from_counter = (data * 2).sum().item(), count.item()
        from_model = output.item()
    assert (from_data, from_counter) == (12.0, 5)
    assert from_model == 1.0  # the placeholder: the model's values do not exist
    [(caller, count)] = mode.placeholders.items()  # this test, by name
    assert caller.endswith(
        ".test_values_from_data_and_counters_are_real_and_the_models_are_placeholders"
    )
    assert count == 1


def test_a_real_tensor_that_a_fake_value_was_added_into_is_no_longer_known():
    with fake_run() as mode:
        total = torch.zeros(())  # a real scalar, as evaluate's running sum
        total.add_(torch.nn.Linear(3, 1)(torch.ones(3)).sum())
        assert not mode.known(total) and total.item() == 1.0


def test_a_fake_norm_is_taken_to_be_finite_so_the_nan_check_stays_clear():
    with fake_run():
        norm = torch.nn.Linear(3, 1)(torch.ones(3)).norm()  # from the model: fake
        nonfinite_step = torch.zeros((), dtype=torch.int64)
        nonfinite_step.masked_fill_(~norm.isfinite(), 7)  # as the Trainer marks it
        assert nonfinite_step.item() == 0


def test_an_output_shaped_by_the_models_values_is_refused_naming_op_and_caller():
    with fake_run(), pytest.raises(DryRunError) as caught:
        torch.nn.Linear(3, 2)(torch.ones(3)).nonzero()
    assert "aten.nonzero" in str(caught.value)
    assert "test_an_output_shaped_by_the_models_values" in str(caught.value)


def test_torch_compile_traces_the_graphs_for_real_on_fake_tensors():
    counters.clear()
    with fake_run():
        model = torch.compile(GPT(SMALL))  # inductor, switched to aot_eager
        idx = torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size))
        model(idx).float().sum().backward()
    # Dynamo captured the forward, AOTAutograd the forward and backward graphs
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["aot_autograd"]["ok"] == 1


def kernel_scratch(run) -> tuple[int, int, str]:
    """Run ``run()`` under the profiler: (peak, largest scratch of one op, peak's op).

    Scratch: the most bytes an operation held inside itself beyond what it
    left allocated when it returned. Both from the allocator's own records.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    allocations, scratch = [], 0

    def visit(event, top: str | None) -> None:
        nonlocal scratch
        if event.tag == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.extra_fields, top))
            return
        if top is None and event.name.startswith("aten::"):
            top, held, most = event.name, 0, 0
            for size in sizes_inside(event):
                held += size
                most = max(most, held)
            scratch = max(scratch, most - max(held, 0))
        for child in event.children:
            visit(child, top)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        visit(root, None)
    allocations.sort(key=lambda allocation: allocation[0])
    held, peak, peak_op = 0, 0, ""
    for _, fields, top in allocations:
        held += fields.alloc_size
        if held > peak:
            peak, peak_op = held, top or ""
    return peak, scratch, peak_op


def sizes_inside(event) -> list[int]:
    """Allocation sizes (negative: frees) anywhere within ``event``, in time order."""
    found, pending = [], list(event.children)
    while pending:
        child = pending.pop()
        if child.tag == _EventType.Allocation:
            found.append((child.start_time_ns, child.extra_fields.alloc_size))
        else:
            pending += child.children
    return [size for _, size in sorted(found)]


def real_step(config: GPTConfig, batch_size: int, precision: str):
    """The step ``gpt_step`` builds, on real CPU tensors, after AdamW's first step."""
    torch.manual_seed(0)
    model = GPT(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    idx = torch.randint(0, config.vocab_size, (batch_size, config.block_size))
    targets = idx.roll(-1, dims=1)

    def step() -> None:
        training_step(model, optimizer, idx, targets, precision)

    step()
    tensors = [*model.parameters(), *model.buffers(), idx, targets]
    tensors += [v for s in optimizer.state.values() for v in s.values()]
    existing = sum(t.numel() * t.element_size() for t in tensors)
    return step, existing


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_fake_peak_is_the_real_peak_less_kernel_scratch(precision, dropout):
    config = replace(SMALL, dropout=dropout)
    fake = fake_peak_bytes(gpt_step(config, batch_size=4, precision=precision).build)
    step, existing = real_step(config, 4, precision)
    peak, scratch, _ = kernel_scratch(step)
    real = existing + peak
    # Every tensor an operation returns is counted on both sides, the scalars the
    # dry run keeps real too; the real peak adds the kernels' scratch, nothing else.
    assert fake <= real <= fake + scratch, (fake, real, scratch)


def test_at_a_peak_inside_attentions_backward_the_gap_is_that_kernels_scratch():
    # One head of width 16 over 1,024 positions: the CPU attention backward's
    # buffers and gradients make its call the step's peak.
    config = GPTConfig(vocab_size=16, block_size=1024, n_layer=1, n_head=1, d_model=16)
    fake = fake_peak_bytes(gpt_step(config, batch_size=1, precision="bf16").build)
    step, existing = real_step(config, 1, "bf16")
    peak, scratch, peak_op = kernel_scratch(step)
    real = existing + peak
    assert "flash_attention" in peak_op and "backward" in peak_op, peak_op
    assert fake <= real <= fake + scratch, (fake, real, scratch)
    # and the scratch is what the fake peak misses there, not a rounding
    assert real - fake > scratch / 2, (fake, real, scratch)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_fake_peak_of_a_gpt_step_is_the_formula_plus_buffers_and_batch(precision):
    step = gpt_step(SMALL, batch_size=4, precision=precision)
    model = GPT(SMALL)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    batch = 2 * 4 * SMALL.block_size * 8  # int64 inputs and targets
    # predict_peak counts neither buffers (the causal mask, RoPE's tables) nor the
    # batch. Beyond them the two differ by a few hundred bytes of 1.09 MB here:
    # 0.5% leaves room for another torch's saved tensors, and is far below a
    # missing activation (about 10%).
    assert fake_peak_bytes(step.build) - buffers - batch == pytest.approx(
        step.formula_cpu, rel=5e-3
    )


@pytest.mark.parametrize("steps", [128, 512])
def test_the_dry_run_and_the_calculators_check_count_with_one_tracker(steps):
    # The dry run's fake mode keeps scalars real; a plain fake mode does not. With
    # one tracker both count every tensor, so the two peaks are the same bytes.
    step = gpt_step(replace(SMALL, block_size=steps), batch_size=2, precision="bf16")

    def build():
        _, _, run = step.build()
        return run

    assert fake_step_peak(build) == fake_peak_bytes(step.build)


def test_the_gpu_steps_have_the_gpu_profiles_shapes_and_precision():
    profile = gpu_profile(torch.device("cpu"))
    steps = gpu_steps(profile, char_vocab_size=65)
    assert set(steps) == {"lm", "lab", "memory", "memory-fp32"}
    longest, rows = max(profile.memory.seq_lens), profile.memory.batch_size
    assert f"{rows} x {longest}, bf16" in steps["memory"].name
    assert f"{rows} x {longest}, fp32" in steps["memory-fp32"].name
    lm = profile.lm
    assert f"{lm.batch_size} x {lm.block_size}, bf16" in steps["lm"].name
    # chapter 3's model has dropout: the CPU's math path keeps (T, T) tensors
    assert steps["lm"].formula_cpu > steps["lm"].formula_cuda


def dry_run(out: Path, *arguments: str, python: list[str] | None = None):
    """``examples/gpu_results.py --dry-run`` at the cpu sizes, as a program."""
    command = python or [sys.executable, str(SCRIPT)]  # python: another launcher
    return subprocess.run(
        [
            *command,
            "--out",
            str(out),
            "--dry-run",
            "--dry-run-sizes",
            "cpu",
            *arguments,
        ],
        cwd=ROOT,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=DRY_RUN_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def dry_run_files(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("dry-run")
    done = dry_run(out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


@pytest.mark.slow
def test_the_dry_run_runs_every_run_and_marks_its_files(dry_run_files):
    out, printed = dry_run_files
    names = {"lm-cpu", "lm-cpu-fp16", "lab-cpu", "compile-cpu", "memory-cpu"}
    assert {path.name for path in out.iterdir()} == {
        f"{name}-dry-run.json" for name in names
    }
    for run in ("lm", "lab", "compile", "memory"):
        assert find_results(out, run) == []  # the chapters never see them
    for name in names:
        result = read_result(out / f"{name}-dry-run.json")
        assert result.dry_run and result.metrics["dry_run.peak_bytes"] > 0
    for part in SWITCHED:  # what did not run on fake tensors, by name
        assert part in printed
    lab = read_result(out / "lab-cpu-dry-run.json").metrics
    drills = {key.split(".")[0] for key in lab}
    assert {"drill1", "drill2", "drill4", "drill5"} <= drills  # the drills ran
    assert "drill6" not in drills  # saving writes bytes, which fake tensors lack


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lm-cpu", "lm-cpu-fp16"])
def test_the_dry_runs_language_model_logs_and_validates(dry_run_files, name):
    out, _ = dry_run_files
    result = read_result(out / f"{name}-dry-run.json")
    # a history row (the Trainer's log, a sync) and a validation loss (evaluate)
    assert result.history["train"]["step"] == [2.0]
    assert result.history["val"]["step"] == [2.0]
    assert result.metrics["dry_run.placeholder_reads"] > 0


def script(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=DRY_RUN_TIMEOUT_S,
        check=True,
    )


@pytest.fixture(scope="module")
def sources() -> dict[str, list[str]]:
    """Each run's sources, as the script derives them (``--sources``)."""
    return json.loads(script(str(SCRIPT), "--sources").stdout)


def test_each_runs_sources_are_the_modules_it_uses_and_what_they_import(sources):
    code = "code/torchbook/"
    # the lm run's Trainer builds on optim and device; the memory run's step on loss
    assert {f"{code}optim.py", f"{code}device.py"} <= set(sources["lm"])
    assert f"{code}loss.py" in sources["memory"]
    lab = f"{code}book/lab.py"
    assert lab in sources["lab"] and lab not in sources["lm"]
    # importing torchbook.memory.measure runs the folder's __init__.py first
    assert f"{code}memory/__init__.py" in sources["memory"]
    assert all("examples/gpu_results.py" in files for files in sources.values())
    # Python's own record of what the script imports: each module in some run's list
    # but the dry run's, which writes its files' lists itself
    imported = set()
    for line in script("-X", "importtime", str(SCRIPT), "--help").stderr.split("\n"):
        name = line.rsplit("|", 1)[-1].strip()
        if name.startswith("torchbook."):
            path = Path("code", *name.split("."))
            is_package = (ROOT / path / "__init__.py").is_file()
            path = path / "__init__.py" if is_package else path.with_suffix(".py")
            imported.add(path.as_posix())
    used = set().union(*map(set, sources.values()))
    dry_run_only = {"book/dry_run.py", "book/gpu_fit.py", "memory/tracker.py"}
    dry_run_only.add("memory/fit.py")  # gpu_fit's
    assert imported - used == {f"{code}{path}" for path in dry_run_only}


@pytest.mark.slow
def test_a_dry_run_file_lists_its_runs_sources_and_the_dry_runs(dry_run_files, sources):
    out, _ = dry_run_files
    dry_run = read_result(out / "lm-cpu-dry-run.json").provenance["sources"]
    assert set(sources["lm"]) | {"code/torchbook/book/dry_run.py"} <= set(dry_run)


BREAK_AND_RUN = """
import importlib, runpy, sys
owner = importlib.import_module(sys.argv.pop(1))
*path, name = sys.argv.pop(1).split(".")
for part in path:
    owner = getattr(owner, part)
def broken(*args, **kwargs):
    raise RuntimeError("broken on purpose")
setattr(owner, name, broken)
runpy.run_path(sys.argv.pop(1), run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "attribute", "run"),
    [
        ("torchbook.train", "evaluate", "lm"),  # the validation loss
        ("torch.amp", "GradScaler._unscale_grads_", "lm"),  # fp16's loss scaler
    ],
)
def test_a_change_that_breaks_the_gpu_job_breaks_the_dry_run(
    tmp_path, module, attribute, run
):
    python = [sys.executable, "-c", BREAK_AND_RUN, module, attribute, str(SCRIPT)]
    done = dry_run(tmp_path, "--only", run, python=python)
    assert done.returncode != 0 and "broken on purpose" in done.stderr, (
        done.stdout[-2000:] + done.stderr[-2000:]
    )
