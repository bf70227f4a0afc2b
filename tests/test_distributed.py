"""Distributed training run for real: two gloo ranks under torchrun, against one.

Each two-rank job runs once per module: ``examples/parallel_checks.py`` (DDP, then
FSDP2, on the same global batches, then a DCP checkpoint), ``examples/train_ddp.py``
as two nodes, and a worker of this file's own (a training checkpoint saved and
resumed by both ranks, FSDP2 with a chunked loss). Every launch goes through
``torchbook.distributed.launch``, which kills every process of the job on a timeout
or a failure, so a failing test leaves no workers.
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchbook import checkpoint as ckpt
from torchbook.book.download import shakespeare_path
from torchbook.book.profiles import active_profile
from torchbook.chat import IGNORE_INDEX
from torchbook.data import StreamConfig, TokenStream
from torchbook.distributed import (
    LaunchError,
    backend_for,
    free_port,
    init_distributed,
    launch,
    launch_together,
    local_bytes,
    mean_over_ranks,
    rank_slice,
    torchrun_command,
    torchrun_node_command,
)
from torchbook.models import GPT, GPTConfig
from torchbook.shards import read_shards, write_shards
from torchbook.train import TrainConfig, Trainer

ROOT = Path(__file__).resolve().parents[1]

STEPS, ACCUM, ROWS, BLOCK = 4, 2, 8, 16
MODEL = dict(vocab_size=64, block_size=BLOCK, n_layer=2, n_head=2, d_model=32)
LR = 3e-3
TRAIN = dict(
    max_steps=STEPS,
    lr=LR,
    min_lr=LR / 10,
    warmup_steps=1,
    accum_steps=ACCUM,
    log_every=1,
)
SEED = 3
# the job takes ~20 s on 2 busy cores; a hung collective is killed long before pytest's
JOB_TIMEOUT_S = 240


def global_batches() -> dict:
    """Token batches whose second half (rank 1's rows) ignores far more targets."""
    generator = torch.Generator().manual_seed(0)
    shape = (STEPS, ACCUM, ROWS, BLOCK)
    x = torch.randint(0, MODEL["vocab_size"], shape, generator=generator)
    y = torch.randint(0, MODEL["vocab_size"], shape, generator=generator)
    ignore_rate = torch.where(torch.arange(ROWS) < ROWS // 2, 0.1, 0.7).view(
        1, 1, ROWS, 1
    )
    y[torch.rand(shape, generator=generator) < ignore_rate] = IGNORE_INDEX
    return {"x": x, "y": y, "model": MODEL, "train": TRAIN, "seed": SEED}


def one_process_run(data: dict) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, each micro-batch whole: the weights and the gradient norms."""
    torch.manual_seed(data["seed"])
    model = GPT(GPTConfig(**data["model"]))
    trainer = Trainer(model, TrainConfig(**data["train"]), "cpu")
    norms = [
        trainer.train_step(
            [(data["x"][step, k], data["y"][step, k]) for k in range(ACCUM)]
        ).grad_norm.item()
        for step in range(STEPS)
    ]
    return model.state_dict(), norms


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parallel")
    data = global_batches()
    torch.save(data, folder / "batches.pt")
    launch(
        torchrun_command(
            ROOT / "examples" / "parallel_checks.py",
            ["--batches", folder / "batches.pt", "--out", folder],
        ),
        timeout_s=JOB_TIMEOUT_S,
        cwd=ROOT,
    )
    return folder, data


@pytest.mark.slow
def test_ddp_on_two_ranks_matches_one_process_on_the_global_batch(two_rank_run):
    folder, data = two_rank_run
    ddp = torch.load(folder / "ddp_weights.pt", weights_only=True)
    reference, _ = one_process_run(data)
    assert ddp.keys() == reference.keys()
    worst = max((ddp[name] - reference[name]).abs().max().item() for name in reference)
    # Summation order differs (per-rank sums, then an all-reduce), ~1e-7 relative in a
    # gradient. AdamW divides each element by its own RMS, so an element whose gradient
    # is near zero can move by a sizeable part of lr on a rounding difference: allow
    # 1% of the largest possible movement, lr x steps. A per-rank mean (the bug the
    # global token count fixes) misses by far more.
    assert worst <= 0.01 * LR * STEPS, f"DDP and one process differ by {worst:.3g}"


@pytest.mark.slow
def test_ddp_gradient_norms_match_one_process(two_rank_run):
    # AdamW's update barely depends on the gradient's scale, so the weights alone would
    # not notice a gradient off by a constant factor (a missing "x world_size"); the
    # norm before clipping does.
    folder, data = two_rank_run
    ddp_norms = json.loads((folder / "results.json").read_text())["ddp_grad_norms"]
    _, reference_norms = one_process_run(data)
    # float32 summation order: ~1e-7 relative in the gradient, a little more after
    # 3 AdamW steps
    np.testing.assert_allclose(ddp_norms, reference_norms, rtol=1e-4)


@pytest.mark.slow
def test_fsdp_loss_equals_ddp_loss(two_rank_run):
    folder, _ = two_rank_run
    results = json.loads((folder / "results.json").read_text())
    ddp, fsdp = np.array(results["ddp_losses"]), np.array(results["fsdp_losses"])
    assert len(ddp) == len(fsdp) == STEPS
    # reduce-scatter and all-reduce sum in different orders: float32 rounding, ~1e-7
    np.testing.assert_allclose(fsdp, ddp, rtol=1e-5)
    assert results["fsdp_parameter"]["type"] == "DTensor"
    assert (
        results["fsdp_parameter"]["local_shape"][0] * 2
        == results["fsdp_parameter"]["global_shape"][0]
    )


@pytest.mark.slow
# one process is the intent
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_checkpoint_of_two_ranks_loads_into_one_process_unchanged(two_rank_run):
    folder, data = two_rank_run
    # FSDP2's own gather, on rank 0
    gathered = torch.load(folder / "fsdp_full.pt", weights_only=True)
    model = GPT(GPTConfig(**data["model"]))
    state = {"model": model.state_dict()}
    # one process reads every shard
    dcp.load(state, checkpoint_id=folder / "dcp", no_dist=True)
    model.load_state_dict(state["model"])
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, gathered[name]), (
            f"{name} changed in the DCP round trip"
        )


def test_rank_split_serves_every_block_once(tmp_path):
    paths = write_shards(
        np.arange(1000) % 50, tmp_path, 50, "test", tokens_per_shard=300
    )
    seen = []
    for rank in range(2):
        stream = TokenStream(
            paths,
            StreamConfig(block_size=8, batch_size=4, seed=5, rank=rank, world_size=2),
        )
        seen.extend(stream.rank_batches(epoch=0).ravel().tolist())
    used = stream.batches_per_epoch * 2 * 4
    assert len(seen) == len(set(seen)) == used, (
        "a block was served twice or a batch is missing"
    )
    assert stream.num_blocks - used == stream.dropped_blocks_per_epoch


def test_rank_slice_refuses_a_global_batch_that_does_not_split_evenly():
    with pytest.raises(ValueError, match="7 rows does not split evenly over 2 ranks"):
        rank_slice(torch.zeros(7, 3), rank=0, world_size=2)


def test_backend_is_nccl_on_cuda_and_gloo_on_the_cpu():
    assert (
        backend_for("cuda"),
        backend_for(torch.device("cuda", 1)),
        backend_for("cpu"),
    ) == ("nccl", "nccl", "gloo")


def test_mean_over_ranks_without_a_process_group_is_the_value_itself():
    value = torch.tensor(2.5)
    assert mean_over_ranks(value).item() == 2.5


def test_local_bytes_counts_parameters_and_both_adamw_moments():
    model = torch.nn.Linear(3, 5)  # 15 + 5 float32 elements
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    held = local_bytes(model, optimizer)
    step_counters = 2 * 4  # AdamW keeps a float32 step count per parameter tensor
    assert held == {"parameters": 20 * 4, "optimizer_state": 2 * 20 * 4 + step_counters}


def test_launch_reports_a_failed_command_with_its_output():
    with pytest.raises(LaunchError, match=r"exited with code 3(.|\n)*the reason"):
        launch(
            [sys.executable, "-c", "import sys; print('the reason'); sys.exit(3)"],
            timeout_s=60,
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) no longer runs
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")


def _reads(cmdline: Path, text: str) -> bool:
    try:
        return text in cmdline.read_bytes().decode(errors="replace")
    except OSError:  # the process ended while we looked
        return False


def test_launch_kills_children_of_a_job_that_runs_past_its_timeout(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        "sleeper = [sys.executable, '-c', 'import time; time.sleep(600)']\n"
        "child = subprocess.Popen(sleeper)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(LaunchError, match="ran past"):
        launch([sys.executable, "-c", script], timeout_s=3)
    child = int(pid_file.read_text())
    time.sleep(0.2)
    assert not _alive(child), f"the job's child {child} outlived the killed job"


@pytest.mark.slow
def test_a_failing_rank_ends_the_whole_job_with_its_error(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "from torchbook.distributed import cleanup_distributed\n"
        "dist.init_process_group('gloo')\n"
        "try:\n"
        "    if dist.get_rank() == 1:\n"
        "        raise RuntimeError('rank 1 fails on purpose')\n"
        "    dist.barrier()  # rank 0 waits for a rank that will never come\n"
        "finally:\n"
        "    cleanup_distributed()\n"
    )
    started = time.monotonic()
    with pytest.raises(LaunchError) as failure:
        launch(torchrun_command(script), timeout_s=JOB_TIMEOUT_S, cwd=ROOT)
    assert "rank 1 fails on purpose" in str(failure.value)
    assert time.monotonic() - started < JOB_TIMEOUT_S
    leftover = [
        cmdline.parent.name
        for cmdline in Path("/proc").glob("[0-9]*/cmdline")
        if _reads(cmdline, str(script))
    ]
    assert not leftover, f"workers {leftover} outlived the failed job"


@pytest.mark.slow
def test_a_failing_rank_leaves_no_child_of_its_own_running(tmp_path):
    # The helper outlives its rank and leaves its session: only the job's environment
    # marker still ties it to the job.
    pid_file = tmp_path / "helper.pid"
    script = tmp_path / "fails_with_a_helper.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    sleeper = [sys.executable, '-c', 'import time; time.sleep(600)']\n"
        "    helper = subprocess.Popen(sleeper, start_new_session=True)\n"
        f"    open({str(pid_file)!r}, 'w').write(str(helper.pid))\n"
        "    sys.exit('rank 1 fails on purpose')\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(LaunchError, match="rank 1 fails on purpose"):
        launch(torchrun_command(script), timeout_s=JOB_TIMEOUT_S)
    helper = int(pid_file.read_text())
    time.sleep(0.2)
    try:
        assert not _alive(helper), f"rank 1's helper {helper} outlived the failed job"
    finally:
        if _alive(helper):  # do not leave it running when the test fails
            os.kill(helper, 9)


def test_init_distributed_sets_the_gpu_of_its_local_rank_before_joining(monkeypatch):
    # Global rank 2 of 4, the second process on a machine with 4 GPUs: its GPU is
    # cuda:1 (LOCAL_RANK), not cuda:2, and it must be current before NCCL starts.
    calls = []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda device: calls.append(("set_device", device))
    )
    distributed = torch.distributed  # the module torchbook.distributed calls
    monkeypatch.setattr(
        distributed,
        "init_process_group",
        lambda backend: calls.append(("join", backend)),
    )
    monkeypatch.setattr(distributed, "get_rank", lambda: 2)
    monkeypatch.setattr(distributed, "get_world_size", lambda: 4)
    context = init_distributed("cuda")
    assert calls == [("set_device", torch.device("cuda", 1)), ("join", "nccl")]
    assert (context.rank, context.device) == (2, torch.device("cuda", 1))


@pytest.mark.slow
def test_a_job_whose_workers_hang_ends_at_its_timeout_with_no_process_left(tmp_path):
    # torchrun starts each worker in a session of its own: killing torchrun's group
    # would miss them.
    script = tmp_path / "hangs.py"
    script.write_text(
        "import os, time\nprint('worker', os.getpid(), flush=True)\ntime.sleep(600)\n"
    )
    started = time.monotonic()
    with pytest.raises(LaunchError, match="ran past 15 s") as failure:
        launch(torchrun_command(script, nproc=2), timeout_s=15)
    waited = time.monotonic() - started
    workers = [
        int(word)
        for line in str(failure.value).splitlines()
        if line.startswith("worker")
        for word in line.split()[1:]
    ]
    assert len(workers) == 2, f"expected both workers to have started:\n{failure.value}"
    # ps and the kills take ~1 s
    assert waited < 15 + 10, f"launch returned {waited:.0f} s after a 15 s timeout"
    assert not [pid for pid in workers if _alive(pid)], (
        "a worker outlived its timed-out job"
    )
    assert not [
        cmdline.parent.name
        for cmdline in Path("/proc").glob("[0-9]*/cmdline")
        if _reads(cmdline, str(script))
    ], "a process of the job is still running"


def _single_process_ddp_reference(shards: list[Path]) -> dict[str, torch.Tensor]:
    """train_ddp.py's run in one process: each micro-batch is both ranks' batches."""
    sizes, seed = active_profile().devices, active_profile().seed
    streams = [
        iter(
            TokenStream(
                shards,
                StreamConfig(
                    block_size=sizes.block_size,
                    batch_size=sizes.micro_batch_size,
                    seed=1,
                    rank=rank,
                    world_size=2,
                    epochs=None,
                ),
            )
        )
        for rank in range(2)
    ]
    torch.manual_seed(seed)
    model = GPT(
        GPTConfig(
            vocab_size=sizes.vocab_size,
            block_size=sizes.block_size,
            n_layer=sizes.n_layer,
            n_head=sizes.n_head,
            d_model=sizes.d_model,
        )
    )
    config = TrainConfig(
        max_steps=sizes.ddp_steps,
        lr=sizes.lr,
        min_lr=sizes.lr / 10,
        warmup_steps=2,
        accum_steps=sizes.accum_steps,
        log_every=sizes.ddp_steps // 3,
    )
    trainer = Trainer(model, config, "cpu")
    for _ in range(sizes.ddp_steps):
        micro_batches = [
            tuple(
                torch.cat(parts)
                for parts in zip(*(next(stream) for stream in streams), strict=False)
            )
            for _ in range(sizes.accum_steps)
        ]
        trainer.train_step(micro_batches)
    return model.state_dict()


@pytest.fixture(scope="module")
def two_node_ddp_run(tmp_path_factory) -> Path:
    """examples/train_ddp.py as two one-process "nodes"; the folder of its output."""
    folder = tmp_path_factory.mktemp("two_nodes")
    # Two torchrun commands, one per "node", meet at a c10d rendezvous: no --standalone.
    text = np.frombuffer(shakespeare_path().read_bytes(), dtype=np.uint8)
    write_shards(
        text, folder / "shards", 256, "bytes", tokens_per_shard=len(text) // 2 + 1
    )
    port = free_port()
    arguments = ["--shards", folder / "shards", "--out", folder / "out"]
    launch_together(
        [
            torchrun_node_command(
                ROOT / "examples" / "train_ddp.py",
                [*arguments, "--device", "cpu"],
                node_rank,
                2,
                port,
            )
            for node_rank in (0, 1)
        ],
        timeout_s=JOB_TIMEOUT_S,
        cwd=ROOT,
    )
    return folder


def _train_ddp_checkpoint(folder: Path) -> ckpt.TrainingCheckpoint:
    return ckpt.read_training_checkpoint(
        ckpt.latest_checkpoint(folder / "out" / "checkpoints")
    )


@pytest.mark.slow
def test_train_ddp_as_two_nodes_matches_one_process(two_node_ddp_run):
    ddp = _train_ddp_checkpoint(two_node_ddp_run).trainer["model"]
    reference = _single_process_ddp_reference(read_shards(two_node_ddp_run / "shards"))
    sizes = active_profile().devices
    worst = max((ddp[name] - reference[name]).abs().max().item() for name in reference)
    # The chapter's tolerance: 1% of lr x steps, the farthest a weight can move (see
    # the first test).
    assert worst <= 0.01 * sizes.lr * sizes.ddp_steps, (
        f"two nodes and one process differ by {worst:.3g}"
    )


@pytest.mark.slow
def test_train_ddp_seeds_each_rank_apart_and_saves_each_ranks_generators(
    two_node_ddp_run,
):
    # Both ranks make the same draws (weights, no dropout): their generators still
    # differ only if they started from different seeds.
    rng = _train_ddp_checkpoint(two_node_ddp_run).rng
    assert len(rng) == 2, f"expected the random states of 2 ranks, got {len(rng)}"
    assert not torch.equal(rng[0]["torch_cpu"], rng[1]["torch_cpu"]), (
        "both ranks saved the same torch generator state: seeded alike"
    )


# A job of two gloo ranks: a training checkpoint saved and resumed by both, then FSDP2
# with a chunked loss. Each rank writes what it saw to a file of its own.
TWO_RANK_WORKER = r"""
import dataclasses, json, os, sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from torchbook import checkpoint as ckpt
from torchbook.distributed import cleanup_distributed, init_distributed, rank_slice
from torchbook.models import GPT, GPTConfig
from torchbook.train import TrainConfig, Trainer

MODEL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32)
TRAIN = dict(max_steps=3, lr=3e-3, warmup_steps=1, accum_steps=2, log_every=1)


def batches(rank, step):
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randint(0, 64, (2, 2, 4, 16), generator=generator)
    return [(rank_slice(x[k], rank, 2), rank_slice(y[k], rank, 2)) for k in range(2)]


def resumed_draws(rank, out):
    # each rank its own seed, as examples/train_ddp.py seeds them
    torch.manual_seed(7 + rank)
    model = DDP(GPT(dataclasses.replace(MODEL, dropout=0.1)))
    trainer = Trainer(model, TrainConfig(**TRAIN), "cpu")
    trainer.train_step(batches(rank, 0))
    ckpt.save_training_checkpoint(out / "ckpt", trainer.state_dict(), device="cpu")
    dist.barrier()  # rank 0 has written the file
    after_save = torch.rand(4).tolist()
    ckpt.load_training_checkpoint(ckpt.latest_checkpoint(out / "ckpt"), trainer)
    return {"after_save": after_save, "after_load": torch.rand(4).tolist()}


def fsdp_losses(rank, loss_chunks):
    torch.manual_seed(3)
    model = GPT(MODEL)
    for block in model.blocks:
        fully_shard(block)
    # the root frees its weights after its forward: the chunked head comes after it
    fully_shard(model, reshard_after_forward=True)
    trainer = Trainer(model, TrainConfig(**TRAIN, loss_chunks=loss_chunks), "cpu")
    return [trainer.train_step(batches(rank, step)).loss.item() for step in range(3)]


context = init_distributed("cpu")
try:
    out = Path(sys.argv[1])
    result = resumed_draws(context.rank, out)
    result["fsdp_losses"] = {k: fsdp_losses(context.rank, k) for k in (1, 2)}
    (out / f"rank{context.rank}.json").write_text(json.dumps(result))
    dist.barrier()
finally:
    cleanup_distributed()
sys.stdout.flush()
os._exit(0)  # gloo's threads may abort a normal exit (see examples/train_ddp.py)
"""


@pytest.fixture(scope="module")
def two_rank_worker_results(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("two_rank_worker")
    script = folder / "worker.py"
    script.write_text(TWO_RANK_WORKER)
    launch(torchrun_command(script, [folder]), timeout_s=JOB_TIMEOUT_S, cwd=ROOT)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_each_rank_resumes_its_own_generators_from_one_checkpoint(
    two_rank_worker_results,
):
    for rank, result in enumerate(two_rank_worker_results):
        assert result["after_load"] == result["after_save"], (
            f"rank {rank} did not get its own generators back"
        )
    first, second = two_rank_worker_results
    assert first["after_save"] != second["after_save"], "the ranks were seeded alike"


@pytest.mark.slow
def test_fsdp2_with_a_chunked_loss_trains_like_the_whole_head(two_rank_worker_results):
    for rank, result in enumerate(two_rank_worker_results):
        whole, chunked = result["fsdp_losses"]["1"], result["fsdp_losses"]["2"]
        # the same float32 terms summed in two slices: a few ulps
        np.testing.assert_allclose(chunked, whole, rtol=1e-5, err_msg=f"rank {rank}")
