"""The gpu profile's own paths in chapters 6 and 7, run on the CPU where they can be.

No GPU runs the tests, so a cell's CUDA branch would first run on a rented GPU.
These tests run what of it needs no GPU: the cell's own code, taken from the
chapter, with CUDA's functions replaced by stand-ins that return what the
documentation says they return (names that do not exist fail, since
``monkeypatch`` refuses to replace a missing attribute), the prose's inline
values after it, and the distributed script with the options the gpu profile
passes.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import torchbook.distributed
from torchbook.book.profiles import active_profile
from torchbook.distributed import launch, torchrun_command

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from qmd_notebook import to_notebook  # noqa: E402


def cell_and_inline_values(chapter: str, marker: str) -> tuple[str, str]:
    """The code cell of ``chapter`` that contains ``marker``, and the inline values
    of the prose after it, up to the next heading."""
    path = ROOT / "chapters" / chapter
    cells = [
        cell
        for cell in to_notebook(path, for_tests=True).cells
        if cell.cell_type == "code"
    ]
    found = [index for index, cell in enumerate(cells) if marker in cell.source]
    assert len(found) == 1, f"{chapter}: {len(found)} cells contain {marker!r}"
    cell = cells[found[0]]
    lines = path.read_text(encoding="utf-8").splitlines()
    start = cell.metadata["qmd_line"]
    section_end = next(
        (n for n in range(start, len(lines) + 1) if lines[n - 1].startswith("#")),
        len(lines) + 1,
    )
    following = cells[found[0] + 1].source if found[0] + 1 < len(cells) else ""
    inline = [
        line
        for line in following.splitlines()
        if following.startswith("# inline values")
        and line.startswith("print(")
        and int(line.rsplit("# line ", 1)[1]) < section_end
    ]
    return cell.source, "\n".join(inline)


def cuda_profile() -> types.SimpleNamespace:
    """A stand-in for the gpu profile: only the device's type is read."""
    return types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))


def fake_event(key, device_type, self_cpu=0, self_device=0, count=1):
    return types.SimpleNamespace(
        key=key,
        count=count,
        device_type=device_type,
        self_cpu_time_total=self_cpu,
        self_device_time_total=self_device,
    )


def test_the_profiler_cell_counts_each_cuda_kernel_once(monkeypatch, capsys):
    from torch.autograd import DeviceType

    # On CUDA each kernel is an event of the GPU's type, and the operation that
    # launched it carries the kernel's time as its own device time.
    events = [
        fake_event("aten::mm", DeviceType.CPU, self_cpu=10, self_device=300, count=4),
        fake_event("sm90_gemm_kernel", DeviceType.CUDA, self_device=300, count=4),
        fake_event("aten::add", DeviceType.CPU, self_cpu=5, self_device=100),
        fake_event("elementwise_kernel", DeviceType.CUDA, self_device=100),
        fake_event("cudaLaunchKernel", DeviceType.CPU, self_cpu=40),
    ]

    namespace = run_profiler_cell(monkeypatch, events)
    assert namespace["total_us"] == 400  # the kernels' time, once
    assert [event.key for event in namespace["top"]] == [
        "aten::mm",
        "aten::add",
        "cudaLaunchKernel",
    ]
    assert namespace["matmul_share"] == pytest.approx(0.75)
    assert "aten::mm" in capsys.readouterr().out


def cuda_memory_stand_ins(monkeypatch, snapshot: dict, reserved_now: int) -> list:
    """Replace the CUDA memory calls the chapter makes; returns the files dumped."""
    dumped = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: snapshot)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dumped.append)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 6 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: reserved_now)
    return dumped


def snapshot_of(*segments: tuple[int, int]) -> dict:
    """A snapshot as ``torch.cuda.memory._snapshot`` documents it, for these
    (total_size, allocated_size) segments."""
    return {
        "segments": [
            {"total_size": total, "allocated_size": allocated, "blocks": []}
            for total, allocated in segments
        ],
        "device_traces": [[]],
    }


def run_allocator_cell(monkeypatch, snapshot: dict, reserved_now: int) -> list:
    cell, _ = cell_and_inline_values("07-memory.qmd", "_record_memory_history")
    dumped = cuda_memory_stand_ins(monkeypatch, snapshot, reserved_now)
    trainer = types.SimpleNamespace(train_step=lambda batches: None)
    namespace = {
        "torch": torch,
        "profile": cuda_profile(),
        "fresh_model": lambda config, shape: None,
        "Trainer": lambda model, config, device: trainer,
        "TrainConfig": lambda: None,
        "config": None,
        "shape": None,
        "idx": None,
        "targets": None,
    }
    exec(cell, namespace)
    return dumped


def test_the_allocator_cell_splits_the_segments_it_is_given(monkeypatch, capsys):
    dumped = run_allocator_cell(
        monkeypatch, snapshot_of((4 * 2**20, 3 * 2**20), (2 * 2**20, 0)), 6 * 2**20
    )
    assert dumped == ["07-memory-snapshot.pickle"]
    out = capsys.readouterr().out
    assert "2 segments of 0.01 GB in all" in out
    assert "cached free blocks 0.00 GB" in out


def test_the_allocator_cells_check_fails_when_segments_miss_reserved_bytes(
    monkeypatch,
):
    with pytest.raises(AssertionError, match="sum of the segments"):
        run_allocator_cell(monkeypatch, snapshot_of((4 * 2**20, 3 * 2**20)), 2**23)


def test_the_expandable_segments_cell_reads_what_growing_batch_prints(
    monkeypatch, capsys
):
    cell, _ = cell_and_inline_values("07-memory.qmd", "expandable_segments:")
    runs = []
    MiB = 2**20
    # what the devlog the chapter cites predicts: 256 MiB reserved without, 140 with
    reserved = {"False": 256 * MiB, "True": 140 * MiB}

    def fake_run(command, env, capture_output, check):
        runs.append((command, env["PYTORCH_CUDA_ALLOC_CONF"]))
        setting = env["PYTORCH_CUDA_ALLOC_CONF"].split(":")[1]
        stdout = f"{128 * MiB} {reserved[setting]}\n".encode()
        return types.SimpleNamespace(stdout=stdout)

    import subprocess

    monkeypatch.setattr(subprocess, "run", fake_run)
    namespace = {"profile": cuda_profile()}
    exec(cell, namespace)
    assert [setting for _, setting in runs] == [
        "expandable_segments:False",
        "expandable_segments:True",
    ]
    # the program each process runs imports and calls the package's own function
    program = runs[0][0][-1]
    compile(program, "RUN", "exec")
    from torchbook.memory.measure import growing_batch  # noqa: F401

    assert "reserved 140 MiB" in capsys.readouterr().out


def run_ddp_job_cell(monkeypatch, tmp_path, gpus: int) -> list[list[str]]:
    """Chapter 6's DDP job cell on the gpu profile with ``gpus`` GPUs; its commands."""
    cell, inline = cell_and_inline_values("06-devices.qmd", "train_ddp.py")
    launched = []

    def fake_launch_together(commands, timeout_s, cwd=None, env=None):
        launched.extend(commands)
        out = tmp_path / "ddp"
        out.mkdir(exist_ok=True)
        log = {
            "history": [{"step": 1, "loss": 5.5}, {"step": 12, "loss": 3.0}],
            "val_loss_mean_over_ranks": 3.1,
        }
        (out / "log.json").write_text(json.dumps(log))
        return ["step   1  loss 5.5000", "rank 0: 4 all-reduces unsynced"]

    monkeypatch.setattr(torchbook.distributed, "launch_together", fake_launch_together)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    namespace = {
        "torch": torch,
        "profile": cuda_profile(),
        "sizes": active_profile().devices,
        "work": tmp_path,
    }
    exec(cell, namespace)
    exec(inline, namespace)
    return launched


def test_the_ddp_job_cell_gives_each_node_its_own_gpu(monkeypatch, tmp_path, capsys):
    launched = run_ddp_job_cell(monkeypatch, tmp_path, gpus=2)
    visible = [word for command in launched for word in command if "VISIBLE" in word]
    assert visible == [f"CUDA_VISIBLE_DEVICES={node}" for node in range(2)]
    assert all(command[-2:] == ["--device", "cuda"] for command in launched)
    shown = capsys.readouterr().out.splitlines()[:2]
    assert shown[0].startswith("CUDA_VISIBLE_DEVICES=0 torchrun --nnodes=2")


def test_the_ddp_job_cell_on_one_gpu_runs_on_the_cpu_and_hides_nothing(
    monkeypatch, tmp_path
):
    # Hiding the GPU would stop the workers: the gpu profile refuses to start
    # without an accelerator, and train_ddp.py reads the profile.
    launched = run_ddp_job_cell(monkeypatch, tmp_path, gpus=1)
    assert all(command[-2:] == ["--device", "cpu"] for command in launched)
    assert not any("VISIBLE" in str(word) for command in launched for word in command)


@pytest.mark.slow
def test_fsdp2_in_bf16_trains_to_ddps_losses_as_the_gpu_profile_runs_it(tmp_path):
    """parallel_checks.py --bf16, the gpu profile's FSDP2 run, on two gloo ranks."""
    sizes = active_profile().devices
    generator = torch.Generator().manual_seed(0)
    rows = sizes.world_size * sizes.micro_batch_size
    shape = (sizes.check_steps, sizes.accum_steps, rows, sizes.block_size)
    data = {
        "x": torch.randint(0, sizes.vocab_size, shape, generator=generator),
        "y": torch.randint(0, sizes.vocab_size, shape, generator=generator),
        "model": dict(
            vocab_size=sizes.vocab_size,
            block_size=sizes.block_size,
            n_layer=sizes.n_layer,
            n_head=sizes.n_head,
            d_model=sizes.d_model,
        ),
        "train": dict(
            max_steps=sizes.check_steps,
            lr=sizes.lr,
            min_lr=sizes.lr / 10,
            warmup_steps=1,
            accum_steps=sizes.accum_steps,
            log_every=1,
        ),
        "seed": 0,
    }
    torch.save(data, tmp_path / "batches.pt")
    arguments = ["--batches", tmp_path / "batches.pt", "--out", tmp_path, "--bf16"]
    launch(
        torchrun_command(ROOT / "examples" / "parallel_checks.py", arguments),
        timeout_s=240,
        cwd=ROOT,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["bf16"]
    ddp, fsdp = np.array(results["ddp_losses"]), np.array(results["fsdp_losses"])
    # The chapter's tolerance for bf16 parameters. bf16 rounds each weight and
    # activation by up to 2^-9 of itself on any device; the losses here agree to
    # ~1e-4, so 1e-2 leaves the CUDA kernels' own rounding a wide margin.
    np.testing.assert_allclose(fsdp, ddp, rtol=1e-2)
    assert np.max(np.abs(fsdp / ddp - 1)) < 1e-3
    # The chapter's count of FSDP2's collectives holds with bf16 gathers too.
    blocks = sizes.n_layer
    assert results["fsdp_parameter"]["collectives"] == {
        "_allgather_base": sizes.accum_steps * (2 * blocks + 1),
        "_reduce_scatter_base": blocks + 1,
        "allreduce": 2,
        "all_reduce": 1,
    }


class CudaStandIn(torch.Tensor):
    """A CPU tensor that says it is on CUDA and refuses what CUDA refuses: one
    operation on it and on a CPU tensor of one or more dimensions (a CPU scalar may
    meet a CUDA tensor, as TensorIterator allows). ``.cpu()`` gives back a plain
    CPU tensor; whatever else it computes stays a stand-in."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from torch.utils import _pytree

        kwargs = kwargs or {}
        if func is torch.Tensor.cpu:
            return torch.Tensor.as_subclass(args[0], torch.Tensor).clone()
        leaves = _pytree.tree_leaves((args, kwargs))
        on_cpu = [
            leaf
            for leaf in leaves
            if isinstance(leaf, torch.Tensor)
            and not isinstance(leaf, cls)
            and leaf.dim() > 0
        ]
        if on_cpu:
            name = getattr(func, "__name__", str(func))
            raise RuntimeError(
                f"{name}: Expected all tensors to be on the same device, but found "
                "at least two devices, cuda:0 and cpu!"
            )
        return super().__torch_function__(func, types, args, kwargs)


def on_cuda_stand_in(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter, and every gradient it gets, a stand-in."""
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            stand_in = parameter.detach().as_subclass(CudaStandIn)
            setattr(module, name, torch.nn.Parameter(stand_in))
    for parameter in model.parameters():
        # autograd's engine hands back plain tensors; on CUDA the gradient of a
        # parameter on CUDA is on CUDA
        parameter.register_post_accumulate_grad_hook(
            lambda p: setattr(p, "grad", p.grad.as_subclass(CudaStandIn))
        )
    return model


def test_the_cuda_stand_in_refuses_a_cpu_tensor_as_cuda_does():
    on_cuda = torch.rand(10).as_subclass(CudaStandIn)
    with pytest.raises(RuntimeError, match="same device"):
        torch.quantile(on_cuda, torch.tensor([0.5]))
    assert (on_cuda * torch.tensor(2.0)).device.type == "cuda"  # a scalar may meet it
    assert type(on_cuda.cpu()) is torch.Tensor


def test_drill_3s_step_sizes_cell_keeps_each_operation_on_one_device(capsys):
    """The lab's quantiles of AdamW's and SGD's first steps, on the gpu profile:
    the model, its gradients, the optimizers' state and the batch on CUDA."""
    from torchbook.book.download import mnist_root
    from torchbook.book.lab import fresh_model
    from torchbook.book.mnist import resident_batches, resident_mnist

    cell, inline = cell_and_inline_values("10-lab.qmd", "torch.quantile(")
    cpu = active_profile()
    images, labels = resident_mnist(mnist_root(), train=True, device="cpu")

    def batches_on_cuda(images, labels, batch_size, generator):
        for batch in resident_batches(images, labels, batch_size, generator):
            yield tuple(tensor.as_subclass(CudaStandIn) for tensor in batch)

    def fresh_model_on_cuda(hidden, seed, device):
        assert device.type == "cuda"
        return on_cuda_stand_in(fresh_model(hidden, seed, torch.device("cpu")))

    namespace = {
        "torch": torch,
        "F": torch.nn.functional,
        "profile": types.SimpleNamespace(device=torch.device("cuda"), seed=cpu.seed),
        "sizes": cpu.lab,
        "data": types.SimpleNamespace(train_images=images, train_labels=labels),
        "resident_batches": batches_on_cuda,
        "fresh_model": fresh_model_on_cuda,
        # what the prose after the cell also reads, from the cells before it
        "adamw_accuracies": [0.98],
        "sgd_accuracies": [0.98],
        "max_optimizer_gap": 0.01,
    }
    exec(cell, namespace)
    exec(inline, namespace)
    assert set(namespace["step_sizes"]) == {"AdamW", "SGD"}
    assert "AdamW: step / learning rate" in capsys.readouterr().out


def run_profiler_cell(monkeypatch, events: list) -> dict:
    """Chapter 6's profiler cell on the gpu profile, the profiler giving ``events``."""
    cell, inline = cell_and_inline_values("06-devices.qmd", "torch.profiler.profile(")

    class FakeProfiler:
        def __init__(self, activities):
            assert torch.profiler.ProfilerActivity.CUDA in activities

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", FakeProfiler)
    namespace = {
        "os": os,
        "torch": torch,
        "profile": cuda_profile(),
        "trainers": {"eager": types.SimpleNamespace(train_step=lambda batch: None)},
        "step_batch": None,
        "synchronize": lambda device: None,
    }
    exec(cell, namespace)
    exec(inline, namespace)
    return namespace


def test_the_profiler_cell_ranks_host_time_when_no_cuda_kernel_was_recorded(
    monkeypatch, capsys
):
    from torch.autograd import DeviceType

    # Where the profiler cannot trace the GPU (CUPTI unavailable), it still records
    # the host's operations, with no kernel events and no device time.
    events = [
        fake_event("aten::mm", DeviceType.CPU, self_cpu=30, count=4),
        fake_event("aten::add", DeviceType.CPU, self_cpu=10),
        fake_event("cudaLaunchKernel", DeviceType.CPU, self_cpu=60, count=5),
    ]
    namespace = run_profiler_cell(monkeypatch, events)
    assert namespace["total_us"] == 100  # the host's time
    assert [event.key for event in namespace["top"]] == [
        "cudaLaunchKernel",
        "aten::mm",
        "aten::add",
    ]
    assert namespace["matmul_share"] == pytest.approx(0.3)
    assert "no CUDA kernel" in capsys.readouterr().out


def test_the_numpy_cell_shows_the_requires_grad_error_on_an_accelerator(capsys):
    from torchbook.book.diagrams import show_error

    cell, _ = cell_and_inline_values("01-tensors.qmd", "away_device =")
    failing_calls = cell.split("\narray = ")[0]  # the fixes copy to the host
    # The meta device stands in for CUDA: `.numpy()` checks a tensor's device
    # before anything else, and refuses every device but the CPU alike.
    namespace = {
        "torch": torch,
        "profile": types.SimpleNamespace(device=torch.device("meta")),
        "x_bf16": torch.ones(3, dtype=torch.bfloat16),
        "show_error": show_error,
    }
    exec(failing_calls, namespace)
    shown = [line for line in capsys.readouterr().out.splitlines() if ": " in line]
    assert namespace["refused"] == ["requires_grad", "meta", "bfloat16"]
    assert "requires grad" in shown[0]
    assert "meta" in shown[1]
