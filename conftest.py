"""Root conftest: lets pytest collect the book's chapters (chapters/*.qmd) as notebooks.

The harness itself lives in tests/chapter_harness.py; pytest only loads a
collection hook for files below the conftest that defines it, hence this file.

Tests run torch single-threaded (unless OMP_NUM_THREADS is already set): the
chapter kernels and the subprocesses that tests start inherit this. On a
machine whose cores other jobs also use, two OpenMP threads per process spin
waiting for each other and a chapter takes several times longer; one thread
costs little on an idle 2-core machine and makes the timings predictable.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest_plugins = ["tests.chapter_harness"]
