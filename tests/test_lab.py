"""The lab's shared pieces and its drill runners (torchbook.book.lab).

The drills themselves run in chapter 10; ``make gpu-results`` reruns them at
the gpu profile's sizes through the functions tested here.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchbook.book import lab
from torchbook.book.mnist import resident_batches
from torchbook.book.profiles import make_profile
from torchbook.book.results import make_provenance, read_result, write_result

ROOT = Path(__file__).resolve().parents[1]


def test_mlp_is_784_256_128_10():
    model = lab.MnistMLP((256, 128))
    # 784*256 + 256 + 256*128 + 128 + 128*10 + 10, written out apart from the class
    assert sum(p.numel() for p in model.parameters()) == 235_146
    assert model(torch.zeros(5, 1, 28, 28)).shape == (5, 10)


def test_fresh_model_repeats_its_weights_for_a_seed():
    first, again, other = (
        lab.fresh_model((16,), seed, torch.device("cpu")) for seed in (3, 3, 4)
    )
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            first.state_dict().values(), again.state_dict().values(), strict=True
        )
    )
    assert not torch.equal(first.layers[1].weight, other.layers[1].weight)


def test_accuracy_and_loss_counts_correct_argmaxes_and_restores_train_mode():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Dropout(0.5), torch.nn.Linear(4, 3)
    )
    images, labels = torch.randn(50, 1, 2, 2), torch.randint(0, 3, (50,))
    accuracy, loss = lab.accuracy_and_loss(model, images, labels)
    model.eval()  # by hand: eval mode (dropout off), no autocast
    with torch.no_grad():
        logits = model(images)
    assert accuracy == pytest.approx((logits.argmax(1) == labels).float().mean().item())
    assert loss == pytest.approx(F.cross_entropy(logits, labels).item())
    model.train()
    lab.accuracy_and_loss(model, images, labels)
    assert model.training, "accuracy_and_loss must leave a training model in train mode"


def test_accumulated_step_equals_one_big_batch_step():
    torch.manual_seed(0)
    images, labels = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))
    model = lab.MnistMLP((32,))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    losses = lab.train_epoch(
        model,
        optimizer,
        scheduler,
        images,
        labels,
        batch_size=128,
        generator=torch.Generator().manual_seed(3),
        accum_steps=4,
    )
    # The same step by hand: the mean loss over the batch, one gradient, p -= lr * grad.
    order = torch.randperm(128, generator=torch.Generator().manual_seed(3))
    loss = F.cross_entropy(reference(images[order]), labels[order])
    loss.backward()
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter -= 0.1 * parameter.grad
    assert len(losses) == 1
    # atol 1e-6: four float32 partial sums against one, about 1e-7 relative
    torch.testing.assert_close(losses[0], loss.detach(), atol=1e-6, rtol=0)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


def test_train_epoch_with_drop_last_takes_only_full_batches():
    model = lab.MnistMLP((8,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    images, labels = torch.randn(100, 1, 28, 28), torch.randint(0, 10, (100,))
    losses = lab.train_epoch(
        model,
        optimizer,
        scheduler,
        images,
        labels,
        32,
        torch.Generator().manual_seed(0),
        drop_last=True,
    )
    assert len(losses) == 3  # 100 // 32; the 4 left over are dropped


def test_sgd_follows_the_same_cosine_as_adamw():
    sizes = make_profile("cpu").lab
    rates = {}
    for name in ("adamw", "sgd"):
        optimizer, scheduler = lab.lab_optimizer(
            name, lab.MnistMLP((8,)), sizes, total_steps=10
        )
        rates[name] = []
        for _ in range(11):
            rates[name].append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    # min_lr 0: for both optimizers a half cosine from the peak to 0, halfway at step 5
    assert rates["adamw"][0] == pytest.approx(sizes.lr) and rates["sgd"][
        0
    ] == pytest.approx(sizes.sgd_lr)
    assert rates["adamw"][5] == pytest.approx(sizes.lr / 2) and rates["sgd"][
        5
    ] == pytest.approx(sizes.sgd_lr / 2)
    assert rates["sgd"][10] == pytest.approx(
        sizes.sgd_lr * sizes.min_lr / sizes.lr, abs=1e-12
    )


def test_results_series_splits_a_history_into_steps_and_epochs():
    history = {
        "step_loss": [2.0, 1.0, 0.5],
        "epoch_accuracy": [0.9],
        "epoch_test_loss": [0.3],
        "epoch_seconds": [1.5],
    }
    series = lab.results_series({"adamw": history})
    assert series["adamw.steps"] == {"step": [1.0, 2.0, 3.0], "loss": [2.0, 1.0, 0.5]}
    assert series["adamw.epochs"] == {
        "epoch": [1.0],
        "accuracy": [0.9],
        "test_loss": [0.3],
        "seconds": [1.5],
    }


def test_epochs_shuffled_counts_the_shuffles_a_generator_drew():
    order = torch.Generator().manual_seed(5)
    images, labels = torch.zeros(10, 1, 2, 2), torch.arange(10)
    for _ in range(2):  # two epochs, in batches of any size
        list(resident_batches(images, labels, 3, order))
    assert lab.epochs_shuffled(order, examples=10, most=5) == 2
    assert lab.epochs_shuffled(order, examples=10, most=1) is None  # past the replay
    torch.rand(1, generator=order)  # a draw that is no shuffle
    assert lab.epochs_shuffled(order, examples=10, most=5) is None


# One line of each kind of call in the wrapper code Inductor writes: a library call
# and a C++ kernel (as chapter 10's CPU run generates them), and a Triton kernel as
# torch/_inductor/codegen/wrapper.py launches it on a GPU, which no test here has.
GENERATED_CODE = """
def call(args):
    buf0 = empty_strided_cpu((128, 256), (256, 1), torch.float32)
    extern_kernels.addmm(primals_2, primals_3, primals_1, alpha=1, beta=1, out=buf0)
    cpp_fused_relu_0(buf0)
    with torch.cuda._DeviceGuard(0):
        extern_kernels.mm(buf1, reinterpret_tensor(primals_4, (256, 128)), out=buf2)
        triton_poi_fused_relu_threshold_backward_1.run(
            buf2, buf3, 32768, stream=stream0
        )
    return (buf0, )
"""


def test_generated_calls_finds_library_cpp_and_triton_calls_in_order():
    assert lab.generated_calls(GENERATED_CODE) == [
        "extern_kernels.addmm",
        "cpp_fused_relu_0",
        "extern_kernels.mm",
        "triton_poi_fused_relu_threshold_backward_1",
    ]


def test_compared_steps_accumulated_equals_whole_batches_in_float64():
    """Drill 4's run: 4 micro-batches and whole batches, the same sums in float64."""
    images, labels = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    runs = [
        lab.compared_steps(
            lab.fresh_model((16,), 0, torch.device("cpu")).double(),
            images.double(),
            labels,
            torch.Generator().manual_seed(1),
            batch_size=32,
            micro_batch_size=micro,
            steps=2,
        )
        for micro in (32, 8)
    ]
    (big_grads, big_state), (grads, state) = runs
    # 1e-12: float64 sums in another order differ by about 1e-16 of their size
    for name in big_grads:
        torch.testing.assert_close(grads[name], big_grads[name], rtol=0, atol=1e-12)
    for name in big_state:
        torch.testing.assert_close(state[name], big_state[name], rtol=0, atol=1e-12)
    initial = lab.fresh_model((16,), 0, torch.device("cpu")).state_dict()
    assert not torch.equal(
        state["layers.1.weight"], initial["layers.1.weight"].double()
    )


@pytest.fixture(scope="module")
def small_lab():
    """The cpu profile with the lab cut to one epoch of 4 steps over part of MNIST."""
    profile = make_profile("cpu")
    data = lab.load_data(profile.device)
    data = lab.MnistTensors(
        data.train_images[:512],
        data.train_labels[:512],
        data.test_images[:256],
        data.test_labels[:256],
    )
    return (
        profile,
        dataclasses.replace(profile.lab, epochs=1, equivalence_steps=3),
        data,
    )


def test_compile_timing_compiles_once_over_an_epoch_of_full_batches(small_lab):
    profile, sizes, data = small_lab
    # 600 images: 4 full batches of 128 and 88 left over, which drop_last leaves out
    data = lab.MnistTensors(
        torch.cat([data.train_images, data.train_images[:88]]),
        torch.cat([data.train_labels, data.train_labels[:88]]),
        data.test_images,
        data.test_labels,
    )
    graphs = []

    def counting_backend(graph, example_inputs):
        """Runs the traced graph as is (no inductor), counting each compilation."""
        graphs.append(graph)
        return graph.forward

    timing = lab.compile_timing(data, sizes, profile, backend=counting_backend)
    assert timing["steps"] == 600 // sizes.batch_size == 4
    assert len(graphs) == 1, f"compiled {len(graphs)} times; drop_last keeps one shape"
    assert timing["eager_step_s"] > 0 and timing["compiled_step_s"] > 0


def test_run_drills_gives_every_number_in_the_results_format(
    small_lab, tmp_path, monkeypatch
):
    profile, sizes, data = small_lab
    monkeypatch.setattr(lab, "compile_timing", lambda *args: {"speedup": 1.0})
    metrics, series = lab.run_drills(data, sizes, profile)
    provenance = make_provenance(
        profile.device, ROOT, ["code/torchbook/book/lab.py"], wall_seconds=1.0
    )
    path = write_result(
        tmp_path / "lab-cpu.json", "lab", "cpu", metrics, series, provenance
    )
    written = read_result(path)  # the format torchbook.book.results validates
    assert written.metrics["drill6.reload_bit_identical"] == 1.0
    assert written.metrics["drill6.safetensors_equal"] == 1.0
    assert written.metrics["drill2.speedup"] == 1.0
    assert len(written.history["adamw.steps"]["loss"]) == 512 // sizes.batch_size
    assert set(written.history) == {
        f"{run}.{kind}"
        for run in ("adamw", "sgd", "accumulated", "bf16")
        for kind in ("steps", "epochs")
    }
