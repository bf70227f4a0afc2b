"""Tests for the lab's building blocks and its script (the drills themselves run in chapter 7)."""

from __future__ import annotations

import copy

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

from torchbook import lab
from torchbook.results import read_result
from torchbook.profiles import make_profile


def test_mlp_is_784_256_128_10():
    model = lab.MLP((256, 128))
    # 784*256 + 256 + 256*128 + 128 + 128*10 + 10, written out independently of the class
    assert sum(p.numel() for p in model.parameters()) == 235_146
    assert model(torch.zeros(5, 1, 28, 28)).shape == (5, 10)


def test_accumulated_step_equals_one_big_batch_step():
    torch.manual_seed(0)
    images, labels = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))
    model = lab.MLP((32,))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    losses = lab.train_epoch(model, optimizer, scheduler, images, labels, batch_size=128,
                             generator=torch.Generator().manual_seed(3), accum_steps=4)
    # The same step by hand: the mean loss over the whole batch, one gradient, p -= lr * grad.
    order = torch.randperm(128, generator=torch.Generator().manual_seed(3))
    loss = F.cross_entropy(reference(images[order]), labels[order])
    loss.backward()
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter -= 0.1 * parameter.grad
    assert len(losses) == 1
    # atol 1e-6: four float32 partial sums against one, about 1e-7 relative
    torch.testing.assert_close(losses[0], loss.detach(), atol=1e-6, rtol=0)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


def test_train_epoch_with_drop_last_takes_only_full_batches():
    model = lab.MLP((8,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    images, labels = torch.randn(100, 1, 28, 28), torch.randint(0, 10, (100,))
    losses = lab.train_epoch(model, optimizer, scheduler, images, labels, 32, torch.Generator().manual_seed(0),
                             drop_last=True)
    assert len(losses) == 3  # 100 // 32; the 4 left over are dropped


def test_sgd_follows_the_same_cosine_as_adamw():
    sizes = make_profile("cpu").lab
    rates = {}
    for name in ("adamw", "sgd"):
        optimizer, scheduler = lab.make_optimizer(name, lab.MLP((8,)), sizes, total_steps=10)
        rates[name] = []
        for _ in range(11):
            rates[name].append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    # min_lr is 0: a half cosine from the peak to 0, halfway at step 5, for both optimizers
    assert rates["adamw"][0] == pytest.approx(sizes.lr) and rates["sgd"][0] == pytest.approx(sizes.sgd_lr)
    assert rates["adamw"][5] == pytest.approx(sizes.lr / 2) and rates["sgd"][5] == pytest.approx(sizes.sgd_lr / 2)
    assert rates["sgd"][10] == pytest.approx(sizes.sgd_lr * sizes.min_lr / sizes.lr, abs=1e-12)


def test_unknown_optimizer_is_refused_by_name():
    with pytest.raises(ValueError, match="'adam'"):
        lab.make_optimizer("adam", lab.MLP((8,)), make_profile("cpu").lab, 10)


def test_safetensors_header_read_by_hand_matches_the_library(tmp_path):
    path = tmp_path / "t.safetensors"
    tensors = {"a": torch.zeros(2, 3), "b": torch.arange(5, dtype=torch.int64)}
    safetensors.torch.save_file(tensors, path)
    header = lab.read_safetensors_header(path)
    with safetensors.safe_open(path, framework="pt") as handle:  # the library's own reading
        for name in handle.keys():
            assert header[name]["shape"] == list(handle.get_slice(name).get_shape())
    assert header["a"]["dtype"] == "F32" and header["b"]["dtype"] == "I64"


def test_results_metrics_flattens_every_number_and_drops_the_rest():
    drills = {"1": {"accuracy": 0.98, "epochs": 3}, "6": {"bit_identical": True, "path": "mlp.pt"},
              "7": {"header": {"a": {}}, "tensors_equal": False}}
    assert lab.results_metrics(drills) == {"drill1.accuracy": 0.98, "drill1.epochs": 3.0,
                                           "drill6.bit_identical": 1.0, "drill7.tensors_equal": 0.0}


def test_results_series_splits_a_history_into_steps_and_epochs():
    history = {"step_loss": [2.0, 1.0, 0.5], "epoch_accuracy": [0.9], "epoch_test_loss": [0.3],
               "epoch_seconds": [1.5]}
    series = lab.results_series({"adamw": history})
    assert series["adamw.steps"] == {"step": [1.0, 2.0, 3.0], "loss": [2.0, 1.0, 0.5]}
    assert series["adamw.epochs"] == {"epoch": [1.0], "accuracy": [0.9], "test_loss": [0.3], "seconds": [1.5]}


def test_script_writes_one_results_file_named_after_the_profile(tmp_path, monkeypatch):
    def small_lab(profile, folder=None):
        history = {"step_loss": [1.0, 0.5], "epoch_accuracy": [0.98], "epoch_test_loss": [0.1],
                   "epoch_seconds": [2.0]}
        return {"drills": {"1": {"accuracy": 0.98}}, "histories": {"adamw": history}}

    monkeypatch.setattr(lab, "run_lab", small_lab)
    assert lab.main(["--profile", "cpu", "--out", str(tmp_path)]) == 0
    written = read_result(tmp_path / "lab-cpu.json")  # the format torchbook.results validates
    assert written.run == "lab" and written.profile == "cpu" and written.metrics == {"drill1.accuracy": 0.98}
    assert written.history["adamw.epochs"]["accuracy"] == [0.98]
    assert set(written.provenance["sources"]) == set(lab.LAB_SOURCES)
    assert [path.name for path in tmp_path.iterdir()] == ["lab-cpu.json"]
