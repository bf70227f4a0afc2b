"""``python -m torchbook.memory``: the memory calculator's command line.

The calculator (``torchbook.memory.calculator``) builds on the GPT formulas in
``torchbook.memory``; running it from this file, rather than from the package's
``__init__``, keeps the two from importing each other.
"""

import sys

from torchbook.memory.calculator import main

sys.exit(main())
