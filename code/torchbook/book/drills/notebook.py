"""``check(N, globals())``: what the exercise notebook's check cells call.

A check cell hands ``check`` the notebook's whole namespace. It looks up the
names drill N's checker takes (its parameters, which are the names each task
asks an answer to leave), says which are still missing, and prints the
checker's verdict instead of raising it, so that "Run All" reaches the end of
the notebook and reports every drill.

It builds on ``torchbook.book.drills.training`` (the checkers of drills 1 to 4)
and ``torchbook.book.drills.after_training`` (drills 5 to 7).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torchbook.book.drills import DrillCheckError
from torchbook.book.drills.after_training import (
    check_drill_5,
    check_drill_6,
    check_drill_7,
)
from torchbook.book.drills.training import (
    check_drill_1,
    check_drill_2,
    check_drill_3,
    check_drill_4,
)

CHECKERS: dict[int, Callable[..., str]] = {
    1: check_drill_1,
    2: check_drill_2,
    3: check_drill_3,
    4: check_drill_4,
    5: check_drill_5,
    6: check_drill_6,
    7: check_drill_7,
}


def check(number: int, namespace: Mapping[str, Any]) -> bool:
    """Run drill ``number``'s checker on names from ``namespace``; print the verdict.

    Returns whether it passed. Nothing is raised, so a notebook run top to
    bottom reports every drill.
    """
    checker = CHECKERS[number]
    names = list(inspect.signature(checker).parameters)
    missing = [name for name in names if name not in namespace]
    if missing:
        print(
            f"drill {number}: not done yet: the cell above should leave "
            + ", ".join(f"`{n}`" for n in missing)
        )
        return False
    try:
        print(checker(*(namespace[name] for name in names)))
        return True
    except DrillCheckError as error:
        print(f"{error}")
    # an answer of the wrong kind: say so, with what the checker expected
    except Exception as error:
        print(
            f"drill {number}: could not check your answer ({type(error).__name__}: "
            f"{error}); the checker takes {', '.join(names)}, as the task says"
        )
    return False
