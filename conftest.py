"""Root conftest: lets pytest collect the book's chapters (chapters/*.qmd) as notebooks.

The harness itself lives in tests/chapter_harness.py; pytest only loads a
collection hook for files below the conftest that defines it, hence this file.

Tests run torch single-threaded (unless OMP_NUM_THREADS is already set): the
chapter kernels and the subprocesses that tests start inherit this. On a
machine whose cores other jobs also use, two OpenMP threads per process spin
waiting for each other and a chapter takes several times longer; one thread
costs little on an idle 2-core machine and makes the timings predictable.

Tests also run as a reader's laptop does (EMULATE_AVX2): most readers' CPUs have
AVX2 and no bf16 instructions, where bf16 runs an order of magnitude slower than
float32 (on one thread of an AVX2 EPYC: 14 times for a transformer layer's step,
50 times for a 512 x 512 matmul). A CPU with AVX512-BF16 or AMX would hide a
chapter that takes minutes there, so ATen's own kernels, oneDNN's (bf16 matmuls
on an AVX-512 CPU) and MKL's (float32 matmuls) are capped at AVX2, so no bf16
instruction is used. Of the three variables, ONEDNN_MAX_CPU_ISA=AVX2 is the one
that makes bf16 slow: on an AVX512-BF16 EPYC, where a bf16 matmul natively runs
faster than float32, that variable alone gave the whole slowdown the three give
together, while ATEN_CPU_CAPABILITY or MKL_ENABLE_INSTRUCTIONS alone changed
nothing measurable (``bench/cpu_bf16.py`` measures it). The other two are kept
so that every kernel library runs the instructions a laptop has. How oneDNN's
AVX2 code compares with PyTorch's own AVX2 path on a real laptop has not been
measured here.
``python bench/cpu_bf16.py`` shows the effect side by side. Set
``BOOK_NATIVE_CPU=1`` to run on the CPU's full instruction set.
"""

import os

import pytest

EMULATE_AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    # torch.compile's C++ backend first test-compiles a probe for every instruction
    # set the CPU reports (AMX, AVX-512, AVX2: about 2 s of g++ each, with a cold
    # cache) and then generates code for ATEN_CPU_CAPABILITY's. A laptop reports
    # only AVX2, so it pays one probe; with this set no probe runs, so a chapter
    # that compiles is charged about one probe less than on a laptop.
    "TORCHINDUCTOR_VEC_ISA_OK": "1",
}

os.environ.setdefault("OMP_NUM_THREADS", "1")
if not os.environ.get("BOOK_NATIVE_CPU"):
    for key, value in EMULATE_AVX2.items():
        os.environ.setdefault(key, value)

pytest_plugins = ["tests.chapter_harness"]


def pytest_report_header(config: pytest.Config) -> str:
    """The CPU capability the chapters run with, first thing in the test log."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    settings = ", ".join(f"{key}={os.environ.get(key)}" for key in EMULATE_AVX2)
    return f"torch {torch.__version__}, CPU capability {capability} ({settings})"
