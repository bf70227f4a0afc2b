"""How much slower bf16 is than float32 here, natively and as a reader's laptop runs it.

Most readers' CPUs (AVX2 only: AMD Zen 2/3, Intel consumer chips, Apple M1 under
Rosetta) have no bf16 instructions, so a bf16 matmul there is emulated and runs
about ten times slower than float32. A CPU with AVX512-BF16 or AMX runs bf16 as
fast as float32 or faster, and hides a chapter that takes minutes on a laptop.
``make test`` runs the chapters under ``EMULATE_AVX2`` (set in conftest.py); this
bench prints bf16's speed relative to float32 with and without it, and with
each setting alone,, measured side by
side in one run, each in a fresh interpreter on one thread.

usage: python bench/cpu_bf16.py [--size 512] [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# The settings conftest.py applies to every test and chapter kernel.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import EMULATE_AVX2  # noqa: E402

MEASURE = """
import sys, time, torch
torch.set_num_threads(1)
size, rounds = int(sys.argv[1]), int(sys.argv[2])
def best_of(work):
    work()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best
def matmul(dtype):
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    return best_of(lambda: a @ b)
def step(dtype):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
    x = torch.randn(8, 64, 256)
    def work():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = layer(x).float().square().mean()
        loss.backward()
    return best_of(work)
print(
    torch.backends.cpu.get_cpu_capability(),
    matmul(torch.float32) / matmul(torch.bfloat16),
    step(torch.float32) / step(torch.bfloat16),
)
"""


def measure(env: dict[str, str], size: int, rounds: int) -> tuple[str, float, float]:
    """(ATen's CPU capability, bf16/fp32 speed of a matmul, of a layer's step)."""
    output = subprocess.run(
        [sys.executable, "-c", MEASURE, str(size), str(rounds)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return output[0], float(output[1]), float(output[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    plain = {key: value for key, value in os.environ.items() if key not in EMULATE_AVX2}
    settings = {"native": {}, **{key: {key: v} for key, v in EMULATE_AVX2.items()}}
    settings["EMULATE_AVX2 (tests)"] = EMULATE_AVX2
    print("bf16 speed relative to float32 (below 1: bf16 is slower), one thread")
    print(f"{'settings':<24}{'capability':>12}{'matmul':>10}{'encoder step':>14}")
    for name, extra in settings.items():
        capability, matmul, step = measure({**plain, **extra}, args.size, args.rounds)
        print(f"{name:<24}{capability:>12}{matmul:>10.2f}{step:>14.2f}")


if __name__ == "__main__":
    main()
