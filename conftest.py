"""Root conftest: lets pytest collect the book's chapters (chapters/*.qmd) as notebooks.

The harness itself lives in tests/chapter_harness.py; pytest only loads a
collection hook for files below the conftest that defines it, hence this file.
"""

pytest_plugins = ["tests.chapter_harness"]
