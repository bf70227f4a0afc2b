"""The lab's exercise notebook as readers meet it; its checkers on good and bad answers.

The notebook is executed here cell by cell in one namespace, as "Run All"
would: once with every TODO cell empty (each check cell must say what is
missing, and nothing may crash), once with answers written below, from
scratch rather than copied from chapter 10 (every checker must pass). Then
each checker is given plausible wrong answers and must fail with a message
that names the mistake.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn.functional as F

from torchbook.book.drills.notebook import check

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from drills_notebook import DEFAULT_TARGET, SOURCE, exercise_notebook, parse_cells  # noqa: E402
from qmd_notebook import QmdError  # noqa: E402

DRILLS = range(1, 8)

# Correct answers, one per TODO cell. Drill 2 compiles with backend="eager": the checker
# judges what torch.compile returns, whatever the backend, and inductor's cold
# compilation would add half a minute to the suite (chapter 10 compiles with inductor).
ANSWERS = {
    1: """
seed, batch_size = 0, 128
model = make_mlp(seed)
initial_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
total_steps = 3 * math.ceil(len(train_labels) / batch_size)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
train_order = torch.Generator().manual_seed(seed)
adamw_losses = []
for epoch in range(3):
    batches = resident_batches(train_images, train_labels, batch_size, train_order)
    for images, labels in batches:
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        adamw_losses.append(loss.item())
""",
    2: """
compiled_model = torch.compile(make_mlp(seed), backend="eager")
eager_model = make_mlp(seed)
step_optimizers = {
    id(m): torch.optim.AdamW(m.parameters(), lr=1e-3)
    for m in (eager_model, compiled_model)
}

def timed_step(m, images, labels):
    started = time.perf_counter()
    F.cross_entropy(m(images), labels).backward()
    step_optimizers[id(m)].step()
    step_optimizers[id(m)].zero_grad()
    return time.perf_counter() - started

order = torch.Generator().manual_seed(seed)
batches = resident_batches(
    train_images, train_labels, batch_size, order, drop_last=True
)
compile_s = timed_step(compiled_model, *next(batches))
eager_times, compiled_times = [], []
for _, (images, labels) in zip(range(20), batches):
    eager_times.append(timed_step(eager_model, images, labels))
    compiled_times.append(timed_step(compiled_model, images, labels))
eager_step_s, compiled_step_s = sorted(eager_times)[10], sorted(compiled_times)[10]
""",
    3: """
sgd_model = make_mlp(seed)
sgd_optimizer = torch.optim.SGD(sgd_model.parameters(), lr=0.05, momentum=0.9)
order = torch.Generator().manual_seed(seed)
sgd_losses = []
for epoch in range(3):
    batches = resident_batches(train_images, train_labels, batch_size, order)
    for images, labels in batches:
        loss = F.cross_entropy(sgd_model(images), labels)
        loss.backward()
        sgd_optimizer.step()
        sgd_optimizer.zero_grad()
        sgd_losses.append(loss.item())
""",
    4: """
def accumulated_epoch(m, opt, order, micro_batches, max_steps=None, scheduler=None):
    batches = resident_batches(train_images, train_labels, 128, order)
    for step, (images, labels) in enumerate(batches):
        if step == max_steps:
            break
        for x, y in zip(images.chunk(micro_batches), labels.chunk(micro_batches)):
            (F.cross_entropy(m(x), y) / micro_batches).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad()

first_grads, states = [], []
for micro_batches in (1, 4):
    m = make_mlp(seed)
    first_order = torch.Generator().manual_seed(seed)
    images, labels = next(
        resident_batches(train_images, train_labels, 128, first_order)
    )
    for x, y in zip(images.chunk(micro_batches), labels.chunk(micro_batches)):
        (F.cross_entropy(m(x), y) / micro_batches).backward()
    first_grads.append({name: p.grad.clone() for name, p in m.named_parameters()})
    m = make_mlp(seed)
    optimizer_20 = torch.optim.AdamW(m.parameters(), lr=1e-3)
    order_20 = torch.Generator().manual_seed(seed)
    accumulated_epoch(m, optimizer_20, order_20, micro_batches, max_steps=20)
    states.append({name: tensor.clone() for name, tensor in m.state_dict().items()})
big_batch_grads, accumulated_grads = first_grads
big_batch_state, accumulated_state = states
accumulated_model = make_mlp(seed)
accumulated_optimizer = torch.optim.AdamW(accumulated_model.parameters(), lr=2e-3)
accumulated_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
    accumulated_optimizer, T_max=total_steps
)
order = torch.Generator().manual_seed(seed)
for epoch in range(3):
    accumulated_epoch(
        accumulated_model,
        accumulated_optimizer,
        order,
        4,
        scheduler=accumulated_scheduler,
    )
accuracy, accumulated_accuracy = test_accuracy(model), test_accuracy(accumulated_model)
print(f"test accuracy {accuracy:.2%}, accumulated {accumulated_accuracy:.2%}")
""",
    5: """
model.eval()
with torch.no_grad():
    fp32_loss = F.cross_entropy(model(test_images), test_labels).item()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(test_images)
    bf16_loss = F.cross_entropy(logits.float(), test_labels).item()
model.train()
""",
    6: """
checkpoint_path = work_folder / "mlp.pt"
torch.save(model.state_dict(), checkpoint_path)
reloaded = make_mlp(seed + 1)
reloaded.load_state_dict(torch.load(checkpoint_path, weights_only=True))
""",
    7: """
import safetensors.torch
safetensors_path = work_folder / "mlp.safetensors"
safetensors.torch.save_file(model.state_dict(), safetensors_path)
""",
}


def todo_number(source: str) -> int | None:
    return int(source.split("drill")[1]) if source.startswith("# TODO: drill") else None


def run_notebook(folder: Path, answers: dict[int, str]) -> tuple[dict, dict[int, str]]:
    """Run the notebook's code cells in one namespace; return it and check outputs."""
    namespace: dict = {"work_folder": folder}
    outputs = {}
    for cell in exercise_notebook(ROOT / SOURCE)["cells"]:
        if cell["cell_type"] != "code":
            continue
        number = todo_number(cell["source"])
        source = answers.get(number, cell["source"]) if number else cell["source"]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(source, f"<cell {cell['id']}>", "exec"), namespace)
        if source.startswith("check("):
            outputs[int(source[6])] = printed.getvalue()
    return namespace, outputs


def checked(number: int, namespace: dict, **changes) -> str:
    """What drill ``number``'s check cell prints for ``namespace`` plus ``changes``."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        check(number, {**namespace, **changes})
    return printed.getvalue()


# ----- the notebook and its source -----


def test_notebook_has_no_quarto_syntax_and_gives_no_solutions_away():
    text = json.dumps(exercise_notebook(ROOT / SOURCE))
    for forbidden in (
        "{python}",
        "@sec-",
        ":::",
        "{#sec-",
        "torchbook.book.lab",
        "drill_1(",
        "Solutions",
    ):
        assert forbidden not in text, f"the notebook contains {forbidden!r}"


def test_notebook_opens_with_the_chapters_setup_cell():
    cells = exercise_notebook(ROOT / SOURCE)["cells"]
    sys.path.insert(0, str(ROOT / "tools"))
    from qmd_notebook import SETUP_CODE

    assert cells[1]["cell_type"] == "code" and cells[1]["source"] == SETUP_CODE


def test_source_with_quarto_syntax_is_refused_with_its_line(tmp_path):
    source = tmp_path / "drills.md"
    source.write_text("# Drills\n\nYou reach `{python} f'{acc:.1%}'` here.\n")
    with pytest.raises(QmdError, match=r"drills.md:3: an inline Quarto value"):
        parse_cells(source)


def test_drill_without_its_check_cell_is_refused(tmp_path):
    text = (
        (ROOT / SOURCE)
        .read_text(encoding="utf-8")
        .replace("check(3, globals())", "print('done')")
    )
    source = tmp_path / "drills.md"
    source.write_text(text)
    with pytest.raises(QmdError, match="the TODO of drill 3 is not followed by check"):
        exercise_notebook(source)


def test_command_writes_the_notebook_it_is_given(tmp_path):
    target = tmp_path / "chapters" / "pytorch_drills.ipynb"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "drills_notebook.py"), str(target)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    assert (
        nbformat.read(str(target), as_version=4)["cells"]
        == exercise_notebook(ROOT / SOURCE)["cells"]
    )


def test_the_chapter_links_the_file_the_pre_render_step_writes():
    """The link resolves only if the file is in the source tree when Quarto renders."""
    chapter = ROOT / "chapters" / "10-lab.qmd"
    target = (ROOT / DEFAULT_TARGET).relative_to(chapter.parent)
    text = chapter.read_text(encoding="utf-8")
    assert f"]({target})" in text and f"href: {target}" in text


@pytest.fixture(scope="module")
def unsolved(tmp_path_factory):
    """The notebook run with every TODO cell empty: (namespace, check outputs)."""
    return run_notebook(tmp_path_factory.mktemp("drills"), answers={})


def test_with_every_todo_empty_each_check_says_what_is_missing(unsolved):
    _, outputs = unsolved
    assert sorted(outputs) == list(DRILLS)
    for number, printed in outputs.items():
        assert printed.startswith(f"drill {number}: not done yet"), printed


# ----- correct answers pass -----


@pytest.fixture(scope="module")
def solved(tmp_path_factory):
    """The notebook run with every answer filled in: (namespace, check outputs)."""
    return run_notebook(tmp_path_factory.mktemp("drills"), ANSWERS)


@pytest.mark.slow
def test_correct_answers_pass_every_check(solved):
    _, outputs = solved
    for number in DRILLS:
        assert outputs[number].startswith(f"drill {number} passed"), outputs[number]


def accumulated_run(
    namespace: dict,
    seed: int,
    micro_batches: int = 4,
    divide: bool = True,
    zero_grad: bool = True,
    steps: int = 20,
) -> dict:
    """Drill 4's names for a run in batches of 128 split into ``micro_batches``.

    From ``make_mlp(seed)``, in the order of a generator seeded with ``seed``,
    AdamW at 1e-3: the first batch's gradients and the weights after ``steps``.
    """
    model = namespace["make_mlp"](seed)
    initial_state = {name: t.clone() for name, t in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = namespace["resident_batches"](
        namespace["train_images"],
        namespace["train_labels"],
        128,
        torch.Generator().manual_seed(seed),
    )
    first_grads = {}
    for _, (images, labels) in zip(range(steps), batches, strict=False):
        for x, y in zip(
            images.chunk(micro_batches), labels.chunk(micro_batches), strict=True
        ):
            loss = F.cross_entropy(model(x), y)
            (loss / micro_batches if divide else loss).backward()
        if not first_grads:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        if zero_grad:
            optimizer.zero_grad()
    return {
        "accumulated_grads": first_grads,
        "accumulated_state": {n: t.clone() for n, t in model.state_dict().items()},
        "initial_state": initial_state,
        "train_order": torch.Generator().manual_seed(seed),
    }


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_correct_accumulation_passes_whatever_the_seed(solved, seed):
    """Float32 rounding differs by seed; the drill-4 rule must hold for each."""
    namespace, _ = solved
    printed = checked(4, namespace, **accumulated_run(namespace, seed))
    assert printed.startswith("drill 4 passed"), printed


# ----- wrong answers fail, naming the mistake -----


@pytest.mark.slow
def test_drill_1_names_an_initial_state_that_aliases_the_model(solved):
    namespace, _ = solved
    printed = checked(1, namespace, initial_state=namespace["model"].state_dict())
    assert (
        "initial_state holds the model's own tensors" in printed
        and "clone()" in printed
    )


def short_run(namespace: dict, steps: int, zero_grad_first: bool | None) -> dict:
    """Drill 1's names after ``steps`` AdamW steps of batches of 128 from seed 0.

    ``zero_grad_first``: True zeroes before the forward (the pytorch/examples
    order), False after the step, None never.
    """
    model = namespace["make_mlp"](0)
    initial_state = {name: t.clone() for name, t in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_order = torch.Generator().manual_seed(0)
    batches = namespace["resident_batches"](
        namespace["train_images"], namespace["train_labels"], 128, train_order
    )
    for _, (images, labels) in zip(range(steps), batches, strict=False):
        if zero_grad_first:
            optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        if zero_grad_first is False:
            optimizer.zero_grad()
    return {
        "model": model,
        "optimizer": optimizer,
        "initial_state": initial_state,
        "train_order": train_order,
    }


@pytest.mark.slow
def test_drill_1_names_a_missing_zero_grad(solved):
    namespace, _ = solved
    printed = checked(1, namespace, **short_run(namespace, 100, None))
    assert (
        "below the 97% target" in printed
        and "is optimizer.zero_grad() called every step?" in printed
    ), printed


@pytest.mark.slow
@pytest.mark.parametrize("zero_grad_first", [True, False])
def test_drill_1_gives_no_zero_grad_hint_to_a_short_run_that_calls_it(
    solved, zero_grad_first
):
    """Zeroing before the forward leaves the last gradients in .grad: no hint."""
    namespace, _ = solved
    printed = checked(1, namespace, **short_run(namespace, 50, zero_grad_first))
    assert "below the 97% target" in printed and "zero_grad" not in printed, printed


@pytest.mark.slow
def test_drill_1_counts_a_fourth_epoch_whatever_the_batch_size_reported(solved):
    namespace, _ = solved
    # keeps them paired
    model, optimizer, train_order = copy.deepcopy(
        (namespace["model"], namespace["optimizer"], namespace["train_order"])
    )
    for images, labels in namespace["resident_batches"](
        namespace["train_images"], namespace["train_labels"], 128, train_order
    ):
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    four_epochs = {"model": model, "optimizer": optimizer, "train_order": train_order}
    # 1,876 steps would be 1 epoch at batches of 32: the size is not trusted
    printed = checked(1, namespace, **four_epochs, batch_size=32)
    assert "shuffled the training set 4 times: 4 epochs" in printed, printed


def drill_1_snapshot(namespace: dict, train_order: torch.Generator) -> dict:
    """Copies of what drill 1's checker is given: generator, weights, optimizer."""
    return {
        "generator": train_order.get_state(),
        "weights": {
            name: tensor.clone()
            for name, tensor in namespace["model"].state_dict().items()
        },
        "optimizer": copy.deepcopy(namespace["optimizer"].state_dict()),
        "grads": [
            None if p.grad is None else p.grad.clone()
            for p in namespace["model"].parameters()
        ],
    }


def same_snapshot(first: dict, second: dict) -> bool:
    def equal(a, b) -> bool:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(map(equal, a, b))
        return type(a) is type(b) and a == b

    return equal(first, second)


@pytest.mark.slow
def test_drill_1_refuses_a_train_order_never_drawn_from_and_changes_nothing(solved):
    """The run shuffled its epochs with other generators (a new one each epoch):
    the generator it leaves is as seeded, so its epochs cannot be counted."""
    namespace, _ = solved
    unused = torch.Generator().manual_seed(0)  # drill 1's seed, never drawn from
    before = drill_1_snapshot(namespace, unused)
    printed = checked(1, namespace, train_order=unused)
    steps = len(namespace["adamw_losses"])
    assert printed.startswith("drill 1: ") and "passed" not in printed, printed
    assert "train_order was never drawn from" in printed, printed
    assert f"{steps:,} steps" in printed, printed
    assert same_snapshot(drill_1_snapshot(namespace, unused), before)


@pytest.mark.slow
def test_drill_1_refuses_more_steps_than_train_orders_epochs_hold(solved):
    """One epoch drawn from train_order, the rest of the run from other generators."""
    namespace, _ = solved
    one_epoch = torch.Generator().manual_seed(0)
    next(
        namespace["resident_batches"](
            namespace["train_images"], namespace["train_labels"], 128, one_epoch
        )
    )
    before = drill_1_snapshot(namespace, one_epoch)
    printed = checked(1, namespace, train_order=one_epoch, batch_size=128)
    steps = len(namespace["adamw_losses"])
    assert "train_order shuffled 1 epoch" in printed, printed
    assert f"at most 469 steps of batches of 128, but the optimizer took {steps:,}" in (
        printed
    ), printed
    assert same_snapshot(drill_1_snapshot(namespace, one_epoch), before)


@pytest.mark.slow
def test_drill_1_names_a_model_rebuilt_after_its_optimizer(solved):
    namespace, _ = solved
    rebuilt = namespace["make_mlp"](0)  # drill 1's seed: its initial weights
    printed = checked(1, namespace, model=rebuilt)
    assert "parameters not moving from their initial values" in printed, printed


@pytest.mark.slow
def test_drill_2_refuses_an_eager_model(solved):
    namespace, _ = solved
    printed = checked(2, namespace, compiled_model=namespace["eager_model"])
    assert "Sequential is not compiled" in printed


@pytest.mark.slow
def test_drill_2_accepts_a_model_compiled_in_place(solved):
    namespace, _ = solved
    model = namespace["make_mlp"](0)
    model.compile(backend="eager")  # in place: no _orig_mod wrapper
    printed = checked(2, namespace, compiled_model=model)
    assert printed.startswith("drill 2 passed"), printed


@pytest.mark.slow
def test_drill_3_refuses_adamw_and_sgd_without_momentum(solved):
    namespace, _ = solved
    parameters = list(namespace["sgd_model"].parameters())
    assert "AdamW, not torch.optim.SGD" in checked(
        3, namespace, sgd_optimizer=torch.optim.AdamW(parameters)
    )
    assert "momentum is 0, expected 0.9" in checked(
        3, namespace, sgd_optimizer=torch.optim.SGD(parameters, lr=0.05)
    )


# What an answer may also report: numbers the drill 4 checker reads none of.
REPORTED = {"compared_steps": 20, "big_batch_accuracy": 0.98}


def drill_4_answer(namespace: dict, **mistakes) -> dict:
    """Drill 4's names, both ways from seed 0, the accumulated way with ``mistakes``."""
    big_batch = accumulated_run(namespace, 0, micro_batches=1)
    answer = accumulated_run(namespace, 0, **mistakes)
    return (
        answer
        | REPORTED
        | {
            "big_batch_grads": big_batch["accumulated_grads"],
            "big_batch_state": big_batch["accumulated_state"],
            "accumulated_accuracy": 0.98,
        }
    )


@pytest.mark.slow
def test_drill_4_names_a_loss_not_divided_by_its_gradients(solved):
    namespace, _ = solved
    printed = checked(4, namespace, **drill_4_answer(namespace, divide=False))
    assert "are 4 times as large: divide each micro-batch's loss" in printed, printed


@pytest.mark.slow
def test_drill_4_names_a_missing_zero_grad_in_both_loops(solved):
    """Both ways without zero_grad agree with each other, not with the checker."""
    namespace, _ = solved
    big_batch = accumulated_run(namespace, 0, micro_batches=1, zero_grad=False)
    answer = drill_4_answer(namespace, zero_grad=False) | {
        "big_batch_grads": big_batch["accumulated_grads"],
        "big_batch_state": big_batch["accumulated_state"],
    }
    printed = checked(4, namespace, **answer)
    assert (
        "of the weights differ by more than 1e-06 from the checker's own 20" in printed
        and "one step and one zero_grad per batch" in printed
    ), printed


@pytest.mark.slow
def test_drill_4_refuses_an_answer_that_never_trained(solved):
    """Initial weights left as "after the steps", an untrained accumulated model."""
    namespace, _ = solved
    answer = drill_4_answer(namespace)
    untrained = answer["initial_state"]
    answer |= {
        "big_batch_state": untrained,
        "accumulated_state": {n: t.clone() for n, t in untrained.items()},
        "accumulated_model": namespace["make_mlp"](1),
    }
    printed = checked(4, namespace, **answer)
    assert (
        "accumulated_state still holds initial_state's weights" in printed
        and "(accumulated) differ by" in printed
    ), printed


@pytest.mark.slow
def test_drill_4_refuses_drill_1s_model_as_the_accumulated_one(solved):
    namespace, _ = solved
    printed = checked(4, namespace, accumulated_model=namespace["model"])
    assert "accumulated_model has drill 1's weights" in printed, printed


@pytest.mark.slow
def test_drill_4_refuses_a_comparison_after_too_many_steps(solved):
    namespace, _ = solved
    answer = drill_4_answer(namespace) | accumulated_run(namespace, 0, steps=100)
    printed = checked(4, namespace, **answer | {"compared_steps": 100})
    assert "from the checker's own 20 big-batch steps" in printed, printed


@pytest.mark.slow
def test_drill_5_explains_bf16_weights_instead_of_autocast(solved):
    namespace, _ = solved
    # the mistake: the weights themselves cast
    bf16_model = copy.deepcopy(namespace["model"]).to(torch.bfloat16)
    printed = checked(5, namespace, model=bf16_model)
    assert (
        "not float32: model.to(torch.bfloat16) rounds the weights" in printed
        and "torch.autocast" in printed
    )


@pytest.mark.slow
def test_drill_5_refuses_autocast_left_off(solved):
    namespace, _ = solved
    printed = checked(5, namespace, bf16_loss=namespace["fp32_loss"])
    assert "identical: was autocast enabled" in printed


@pytest.mark.slow
def test_drill_6_refuses_a_pickled_model_object(solved, tmp_path):
    namespace, _ = solved
    path = tmp_path / "whole.pt"
    # the mistake: the module object, not its state dict
    torch.save(namespace["model"], path)
    reloaded = torch.load(path, weights_only=False)
    printed = checked(6, namespace, checkpoint_path=path, reloaded=reloaded)
    assert (
        "does not load with torch.load(..., weights_only=True)" in printed
        and "model.state_dict()" in printed
    )


@pytest.mark.slow
def test_drill_6_refuses_the_same_object_an_unloaded_model_and_another_shape(solved):
    namespace, _ = solved
    assert "is the original model object" in checked(
        6, namespace, reloaded=namespace["model"]
    )
    assert "did not round-trip" in checked(
        6, namespace, reloaded=namespace["make_mlp"](5)
    )
    wider = torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(784, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    assert "the reloaded model has other parameters" in checked(
        6, namespace, reloaded=wider
    )


@pytest.mark.slow
def test_drill_6_refuses_a_file_of_the_initial_weights(solved, tmp_path):
    namespace, _ = solved
    path = tmp_path / "early.pt"
    torch.save(namespace["initial_state"], path)  # saved before training
    assert "holds other weights than the model's" in checked(
        6, namespace, checkpoint_path=path
    )


@pytest.mark.slow
def test_drill_7_refuses_a_torch_save_file_and_other_weights(solved, tmp_path):
    namespace, _ = solved
    pickled = tmp_path / "mlp.safetensors"
    torch.save(namespace["model"].state_dict(), pickled)  # a zip named .safetensors
    assert "mlp.safetensors is not a safetensors file" in checked(
        7, namespace, safetensors_path=pickled
    )
    import safetensors.torch

    other = tmp_path / "initial.safetensors"
    safetensors.torch.save_file(namespace["initial_state"], other)
    assert "tensors differ from the model's" in checked(
        7, namespace, safetensors_path=other
    )
