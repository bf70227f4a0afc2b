"""The lab's checkers and its exercise notebook.

Each checker passes on the solved drill (the lab's own functions, the chapter's
solutions) and fails, with its message, on a deliberately wrong answer. The
exercise notebook is generated from chapter 7; filled in with the solutions it
is cell for cell the chapter, which the chapter test executes under nbval.
That is the execution of the filled-in notebook: running it a second time here
would double the lab's minutes without testing anything more.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

from torchbook import lab
from torchbook.drills import (
    DrillCheckError, check_drill_1, check_drill_2, check_drill_3, check_drill_4, check_drill_5, check_drill_6,
    check_drill_7,
)
from torchbook.profiles import make_profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from drills_notebook import exercise_notebook, write_exercise_notebook  # noqa: E402
from qmd_notebook import QmdError, to_notebook  # noqa: E402

CHAPTER = ROOT / "chapters" / "08-lab.qmd"
DRILLS = range(1, 8)


# ----- the exercise notebook -----


def code_cells(notebook: dict) -> list[dict]:
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


def test_every_drill_is_a_todo_followed_by_its_check():
    cells = code_cells(exercise_notebook(CHAPTER))
    todos = [i for i, cell in enumerate(cells) if "drill_solution" in cell["metadata"]]
    assert [cells[i]["metadata"]["drill_solution"] for i in todos] == list(DRILLS)
    for number, index in zip(DRILLS, todos):
        todo, check = cells[index]["source"], cells[index + 1]["source"]
        assert todo.endswith("# TODO: your code here") and all(line.startswith("#") for line in todo.splitlines())
        assert f"check_drill_{number}(" in check, f"drill {number}: the cell after the TODO does not check it"


def test_filled_in_exercise_notebook_is_the_chapter():
    chapter_cells = code_cells(to_notebook(CHAPTER))
    exercise_cells = code_cells(exercise_notebook(CHAPTER))
    assert len(exercise_cells) == len(chapter_cells)
    filled = [chapter["source"] if "drill_solution" in mine["metadata"] else mine["source"]
              for mine, chapter in zip(exercise_cells, chapter_cells)]
    assert filled == [cell["source"] for cell in chapter_cells]
    removed = sum(mine["source"] != chapter["source"] for mine, chapter in zip(exercise_cells, chapter_cells))
    assert removed == len(DRILLS), "only the seven solutions may differ from the chapter"


def test_chapter_without_a_check_cell_is_refused(tmp_path):
    chapter = tmp_path / "08-lab.qmd"
    chapter.write_text("# Lab\n\n```{python}\n#| label: solution-drill-1\n# Drill 1: train.\nx = 1\n```\n")
    with pytest.raises(QmdError, match=r"drills \[1\] but check cells for \[\]"):
        exercise_notebook(chapter)


def test_command_writes_the_notebook_beside_the_chapter_page(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "tools" / "drills_notebook.py"), str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True)
    assert (tmp_path / "chapters" / "pytorch_drills.ipynb").is_file()
    assert write_exercise_notebook(ROOT, tmp_path).name == "pytorch_drills.ipynb"


# ----- the checkers, on solved drills and on wrong answers -----


@pytest.fixture(scope="module")
def solved():
    """The lab's drills 1, 3 and 4 on the cpu profile, run once for every checker test."""
    profile = make_profile("cpu")
    data = lab.load_data(profile.device)
    model, initial, first = lab.drill_1(data, profile)
    third = lab.drill_3(data, profile, first["history"])
    _, states, fourth = lab.drill_4(data, profile, first["history"])
    return {"profile": profile, "data": data, "model": model, "initial": initial, "first": first,
            "third": third, "states": states, "fourth": fourth}


@pytest.mark.slow
def test_drill_1_check_passes_the_trained_model(solved):
    data = solved["data"]
    message = check_drill_1(solved["model"], solved["initial"], data.test_images, data.test_labels, 3)
    assert message.startswith("drill 1 passed")


@pytest.mark.slow
def test_drill_1_check_names_an_untrained_model_and_too_many_epochs(solved):
    data, profile = solved["data"], solved["profile"]
    untrained = lab.fresh_model(profile.lab, profile.seed, profile.device)
    with pytest.raises(DrillCheckError) as caught:
        check_drill_1(untrained, solved["initial"], data.test_images, data.test_labels, 4)
    for expected in ("at most 3", "not moving", "below the 97% target"):
        assert expected in str(caught.value)


@pytest.mark.slow
def test_drill_2_check_passes_a_compiled_model_and_refuses_an_eager_one(solved):
    profile, sample = solved["profile"], solved["data"].test_images[:8]
    compiled = torch.compile(lab.fresh_model(profile.lab, profile.seed, profile.device))
    assert check_drill_2(compiled, sample, 5.0, 1.0, 0.9).startswith("drill 2 passed")
    with pytest.raises(DrillCheckError, match=r"MLP is not the result of torch.compile.*compile_s = -1"):
        check_drill_2(solved["model"], sample, -1, 1.0, 0.9)


@pytest.mark.slow
def test_drill_3_check_passes_sgd_and_refuses_adamw_and_short_curves(solved):
    third, adamw_losses = solved["third"], solved["first"]["history"]["step_loss"]
    model = lab.MLP()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sgd_losses = third["history"]["step_loss"]
    assert check_drill_3(sgd, sgd_losses, adamw_losses).startswith("drill 3 passed")
    with pytest.raises(DrillCheckError, match=r"AdamW, not torch.optim.SGD.*share a step axis"):
        check_drill_3(torch.optim.AdamW(model.parameters()), sgd_losses[:100], adamw_losses)
    with pytest.raises(DrillCheckError, match=r"momentum is 0.5"):
        check_drill_3(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5), sgd_losses, adamw_losses)


@pytest.mark.slow
def test_drill_4_check_passes_accumulation_and_refuses_a_mean_per_micro_batch(solved):
    profile, data, fourth = solved["profile"], solved["data"], solved["fourth"]
    big_batch_state, accumulated_state = solved["states"]
    accuracies = fourth["big_batch_accuracy"], fourth["accum_accuracy"]
    assert check_drill_4(big_batch_state, accumulated_state, *accuracies).startswith("drill 4 passed")
    # The common mistake: each micro-batch's own mean loss, so the summed gradient is 4x too large.
    sizes = profile.lab
    model = lab.fresh_model(sizes, profile.seed, profile.device)
    optimizer, scheduler = lab.make_optimizer("adamw", model, sizes, 3 * lab.steps_per_epoch(data, 128))
    batches = lab.resident_batches(data.train_images, data.train_labels, sizes.batch_size,
                                   torch.Generator().manual_seed(profile.seed))
    for _, (images, labels) in zip(range(sizes.equivalence_steps), batches):
        for x, y in zip(images.split(sizes.micro_batch_size), labels.split(sizes.micro_batch_size)):
            F.cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    with pytest.raises(DrillCheckError, match=r"weights differ by up to .*accuracies differ by 1.00%"):
        check_drill_4(big_batch_state, model.state_dict(), accuracies[0], accuracies[0] - 0.01)


@pytest.mark.slow
def test_drill_5_check_passes_real_losses_and_refuses_autocast_left_off(solved):
    data, model = solved["data"], solved["model"]
    _, fp32_loss = lab.evaluate(model, data.test_images, data.test_labels)
    _, bf16_loss = lab.evaluate(model, data.test_images, data.test_labels, torch.bfloat16)
    assert check_drill_5(model, data.test_images, data.test_labels, fp32_loss, bf16_loss).startswith("drill 5 passed")
    with pytest.raises(DrillCheckError, match=r"bf16_loss = .*identical: was autocast enabled"):
        check_drill_5(model, data.test_images, data.test_labels, fp32_loss, fp32_loss)


@pytest.mark.slow
def test_drill_6_check_passes_a_reload_and_refuses_an_untrained_copy(solved, tmp_path):
    profile, data, model = solved["profile"], solved["data"], solved["model"]
    reloaded, _ = lab.drill_6(model, data, profile, tmp_path)
    assert check_drill_6(model, reloaded, data.test_images).startswith("drill 6 passed")
    with pytest.raises(DrillCheckError, match="did not round-trip"):
        check_drill_6(model, lab.MLP(profile.lab.hidden), data.test_images)
    with pytest.raises(DrillCheckError, match="is the original model object"):
        check_drill_6(model, model, data.test_images)


@pytest.mark.slow
def test_drill_7_check_passes_safetensors_and_refuses_a_torch_save_file(solved, tmp_path):
    model = solved["model"]
    _, result = lab.drill_7(model, tmp_path)
    assert check_drill_7(result["path"], model).startswith("drill 7 passed")
    pickled = tmp_path / "mlp.pt"
    torch.save(model.state_dict(), pickled)
    with pytest.raises(DrillCheckError, match=r"mlp.pt is not a safetensors file"):
        check_drill_7(pickled, model)
    other = tmp_path / "other.safetensors"
    safetensors.torch.save_file(lab.MLP().state_dict(), other)
    with pytest.raises(DrillCheckError, match=r"tensors differ from the model's"):
        check_drill_7(other, model)
