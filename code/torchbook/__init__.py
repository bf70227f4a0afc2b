"""torchbook: the tested code behind *PyTorch Essentials for LLM Work*.

Three places, by who they are for:

- the modules at this level are what you copy into your own project. Each reads
  on its own and imports only the libraries its topic needs, at most the two
  small helpers ``device`` and ``files``, and the modules its bullet below says
  it builds on;
- ``memory/`` is the memory calculator's family (``python -m torchbook.memory``);
  copy a module of it with the folder's ``__init__.py``, which Python runs first;
- ``book/`` is what only makes the book: run sizes per profile, stored results,
  plots and diagrams, the data download, the lab's machinery, the dry run and
  the stand-in checkpoint. Nothing outside it imports it; its own
  ``__init__.py`` lists its modules.

The helpers:

- ``device``: the precision dtypes, autocast, the accelerator, ``synchronize`` and
  ``timed``.
- ``files``: the one atomic writer (temporary, fsync, rename, fsync of the folder).

Models, training and data:

- ``models``: the small GPT (pre-norm, RoPE, SDPA, tied head; packed rows with
  per-document masks; optional activation checkpointing), the tutorial TinyMLP,
  parameter counting, ``check_token_ids``.
- ``optim``: AdamW with decay and no-decay groups, the warmup + cosine schedule, a
  changed config applied on resume, the layout check of a saved optimizer state.
- ``train``: the training loop (autocast, fp32 loss, token-normalised accumulation,
  scaler, clipping), the ``Trainer``'s saved state, the gradient arithmetic of DDP
  and FSDP2 (builds on ``chat``, ``optim`` and ``state_dicts``).
- ``shards``: token ids on disk as shards with a header, written atomically,
  checked before use.
- ``data``: the tutorial ``TokenDataset`` and a streaming ``IterableDataset`` over
  shards, split across workers and ranks, resumable (builds on ``shards``).
- ``tokenizer``: a byte-level BPE tokenizer trained locally with ``tokenizers``.
- ``chat``: chat records into training examples (template, prompt masking,
  ``IGNORE_INDEX``, padding, packing with per-document masks).
- ``hf``: the tokenizer and chat template as a ``transformers`` tokenizer (builds on
  ``chat`` and ``tokenizer``).

Saving and loading:

- ``state_dicts``: a model's ``state_dict`` across ``torch.compile`` and DDP
  wrappers, and the key/shape/dtype check to run before ``load_state_dict``.
- ``checkpoint``: exact resume: weights and the full training state, atomic,
  ``weights_only``-safe, rotated, parsed whole before anything changes (builds on
  ``state_dicts``).
- ``weights``: safetensors, a sharded index, loading on the ``meta`` device (builds
  on ``state_dicts``).

Devices and memory:

- ``distributed``: process groups, rank slices, all-reduce counting and launching
  ``torchrun`` jobs that always end.
- ``recompute``: selective activation checkpointing with ``torch.utils.checkpoint``'s
  policy API (builds on ``models``).
- ``memory``: where a GPT's training memory goes, by formula (builds on ``models``).
- ``memory.configs``: a model's shape from a Hugging Face ``config.json`` and its
  exact parameter count.
- ``memory.step``: what a ``transformers`` model's training step stores per rank
  (builds on ``memory.configs``).
- ``memory.peak``: that step's busiest instant (builds on ``memory.configs`` and
  ``memory.step``).
- ``memory.calculator``: the command line: rows in bytes and GB, the assumptions,
  the fit, ``--json`` (builds on ``memory.configs``, ``memory.peak`` and
  ``memory.step``).
- ``memory.check``: the same step of ``transformers``' own model run on fake tensors
  with its peak tracked (builds on ``memory.configs``, ``memory.step`` and
  ``recompute``).
- ``memory.measure``: a step's memory measured without formulas (builds on
  ``train``).
- ``memory.flops``: training FLOPs per token by formula and by ``FlopCounterMode``,
  the matmul peak, MFU (builds on ``memory.measure`` and ``models``).

Other people's models:

- ``llama``: a Llama-family model (RMSNorm, SwiGLU, RoPE with Llama 3's scaling,
  grouped-query attention, a KV cache, sampling) (builds on ``models``).
- ``hf_checkpoint``: a Hugging Face model folder parsed, checked and loaded into
  ``llama``, and saved back (builds on ``llama``, ``state_dicts`` and ``weights``).
- ``lora``: LoRA by hand: adapters on frozen linear layers, merged, or saved in
  PEFT's format (builds on ``weights``).

Scripts a chapter launches (the kill-and-resume run, torchrun jobs) live in
examples/, outside the package.
"""
