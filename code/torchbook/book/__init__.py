"""What only makes the book: nothing outside this folder imports it.

These modules size the book's runs, store and plot their results, draw its
diagrams, fetch its data, run the lab and the dry run of the GPU job, and make
the stand-in checkpoint the build uses because it cannot download one. They may
use anything in the package; a reader copies the modules one level up.

- ``book.profiles``: the one place that picks the device and every run size from
  ``QUARTO_PROFILE``.
- ``book.download``: finds or downloads MNIST and Tiny Shakespeare, verified by
  SHA-256, and names the folder for derived files.
- ``book.mnist``: MNIST from its verified raw IDX files, as a dataset of PIL images
  and as resident tensors.
- ``book.plotting``: loss curves and training diagnostics, memory per kind.
- ``book.diagrams``: pictures drawn from live objects (strides, broadcasting, a
  module tree, one step under DDP or FSDP2) and ``show_error``, the one printer for
  the errors chapters provoke.
- ``book.charlm``: chapter 3's character-level language model as one experiment
  (builds on ``book.profiles``, ``models`` and ``train``).
- ``book.lab``: what the lab's drills share: the MLP, its evaluation, MNIST as
  resident tensors, the drills as runs (builds on ``book.download``,
  ``book.mnist``, ``book.profiles`` and ``optim``).
- ``book.drills``: what the exercise notebook's checkers share: their error, a
  model's test accuracy, two state dicts compared (builds on ``book.lab``).
- ``book.drills.training``: the checkers of drills 1 to 4, which train (builds
  on ``book.lab``).
- ``book.drills.after_training``: the checkers of drills 5 to 7, on drill 1's
  trained model: bf16 autocast, a saved state dict, safetensors (builds on
  ``book.lab``).
- ``book.drills.notebook``: ``check(N, globals())``, which the notebook's check
  cells call (builds on ``book.drills.after_training`` and
  ``book.drills.training``).
- ``book.gpu_fit``: whether the book's GPU runs fit (builds on ``book.charlm``,
  ``book.profiles``, ``memory``, ``memory.fit``, ``memory.gpt`` and ``models``).
- ``book.results``: results of full-size runs as JSON with provenance, and their
  staleness.
- ``book.dry_run``: the GPU job's own run functions at full size on fake tensors
  (builds on ``book.charlm``, ``book.gpu_fit``, ``book.lab``, ``book.profiles``,
  ``memory``, ``memory.gpt``, ``memory.measure``, ``memory.tracker``, ``models``
  and ``train``).
- ``book.stand_in``: the stand-in "pretrained" checkpoint, made with
  ``transformers`` (builds on ``book.profiles``, ``hf`` and ``tokenizer``).
- ``book.questions``: chapter 9's task, chats from Tiny Shakespeare whose answer
  says whether a line asks a question.
"""
