"""How much slower bf16 is than float32 on this CPU, natively and as a reader's laptop runs it.

Most readers' CPUs (AVX2 only: AMD Zen 2/3, Intel consumer chips, Apple M1 under
Rosetta) have no bf16 instructions, so a bf16 matmul there is emulated and runs
about ten times slower than float32. A CPU with AVX512-BF16 or AMX runs bf16 as
fast as float32 or faster, and hides a chapter that takes minutes on a laptop.
``make test`` runs the chapters under ``EMULATE_AVX2`` (set in conftest.py); this
bench prints the bf16/float32 time ratio with and without it, measured side by
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
def seconds(dtype):
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best
fp32, bf16 = seconds(torch.float32), seconds(torch.bfloat16)
flops = 2 * size**3
print(torch.backends.cpu.get_cpu_capability(), flops / fp32 / 1e9, flops / bf16 / 1e9)
"""


def measure(env: dict[str, str], size: int, rounds: int) -> tuple[str, float, float]:
    """(ATen's CPU capability, float32 GFLOP/s, bf16 GFLOP/s) in a fresh interpreter."""
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
    print(
        f"{'settings':<22}{'capability':>12}{'fp32 GFLOP/s':>14}{'bf16 GFLOP/s':>14}{'bf16 slower':>13}"
    )
    for name, env in (("native", plain), ("EMULATE_AVX2", {**plain, **EMULATE_AVX2})):
        capability, fp32, bf16 = measure(env, args.size, args.rounds)
        print(
            f"{name:<22}{capability:>12}{fp32:>14.1f}{bf16:>14.1f}{fp32 / bf16:>12.1f}x"
        )


if __name__ == "__main__":
    main()
