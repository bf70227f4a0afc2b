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

- ``decoder``: what the book's two decoder-only models share: RoPE's tables and
  rotation, the packed rows' mask, attention written out, the token-id and
  position checks, GPT-2's initialisation.
- ``models``: the small GPT (pre-norm, RoPE, SDPA, tied head; packed rows with
  per-document masks; optional activation checkpointing), the tutorial TinyMLP,
  parameter counting (builds on ``decoder``).
- ``optim``: AdamW with decay and no-decay groups, the warmup + cosine schedule, a
  changed config applied on resume, the check of a saved optimizer state.
- ``loss``: the forward under autocast and the cross-entropy in float32, summed
  over the target tokens, over slices of the sequence for a large vocabulary
  (builds on ``chat`` and ``state_dicts``).
- ``trainer_state``: what the ``Trainer`` saves, and a saved state parsed whole
  before anything changes (builds on ``optim`` and ``state_dicts``).
- ``train``: the training loop (autocast, fp32 loss, token-normalised accumulation,
  scaler, clipping, a NaN stop), the gradient arithmetic of DDP and FSDP2 (builds
  on ``chat``, ``loss``, ``optim``, ``state_dicts`` and ``trainer_state``).
- ``shards``: token ids on disk as shards with a header, written atomically,
  checked before use.
- ``data``: the tutorial ``TokenDataset`` and a streaming ``IterableDataset`` over
  shards, split across workers and ranks, resumable (builds on ``shards``).
- ``tokenizer``: a byte-level BPE tokenizer trained locally with ``tokenizers``, and
  documents encoded for shards, each ended by ``<|endoftext|>``.
- ``chat``: chat records into training examples (template, prompt masking,
  ``IGNORE_INDEX``, padding, packing with per-document masks) and their greedy
  accuracy.
- ``hf``: the tokenizer and chat template as a ``transformers`` tokenizer (builds on
  ``chat`` and ``tokenizer``).

Saving and loading:

- ``state_dicts``: a model's ``state_dict`` across ``torch.compile`` and DDP
  wrappers, and the key/shape/dtype check to run before ``load_state_dict``.
- ``rng_state``: the global random generators (Python, NumPy, torch's CPU and
  the accelerator's) captured, checked and restored.
- ``checkpoint``: exact resume: weights and the full training state, atomic,
  ``weights_only``-safe, rotated, parsed whole before anything changes (builds on
  ``rng_state`` and ``state_dicts``).
- ``weights``: safetensors, a sharded index, loading on the ``meta`` device (builds
  on ``state_dicts``).

Devices and memory:

- ``distributed``: process groups, rank slices, all-reduce counting and launching
  ``torchrun`` jobs that always end.
- ``recompute``: selective activation checkpointing with ``torch.utils.checkpoint``'s
  policy API (builds on ``models``).
- ``memory``: the four kinds of training memory, and ``TrainingSetup``, the one
  description of a training step that every formula of the family takes.
- ``memory.gpt``: where the book's GPT's training memory goes, by formula (builds
  on ``models``).
- ``memory.configs``: a model's shape from a Hugging Face ``config.json``, each
  field checked, and its exact parameter count.
- ``memory.step``: what a ``transformers`` model's training step stores per rank,
  a 4-bit (QLoRA) base too (builds on ``memory.configs``).
- ``memory.peak``: that step's busiest instant (builds on ``memory.configs`` and
  ``memory.step``).
- ``memory.fit``: whether a predicted peak fits a GPU of so many GiB, defined once.
- ``memory.calculator``: the command line: rows in bytes and GiB, the assumptions,
  the fit, ``--json`` (builds on ``memory.configs``, ``memory.fit``,
  ``memory.gpt``, ``memory.peak`` and ``memory.step``).
- ``memory.tracker``: the one tracker of a fake-tensor run's memory, PyTorch's
  ``MemTracker`` for a whole run's peak.
- ``memory.check``: the same step of ``transformers``' own model run on fake tensors
  with its peak tracked (builds on ``memory.configs``, ``memory.step``,
  ``memory.tracker`` and ``recompute``).
- ``memory.qlora_step``: a QLoRA step (bitsandbytes' 4-bit base, peft's adapters)
  measured on the CPU (builds on ``memory.check``, ``memory.configs``,
  ``memory.measure`` and ``memory.step``).
- ``memory.measure``: a step's memory measured without formulas (builds on
  ``loss``).
- ``memory.flops``: training FLOPs per token by formula and by ``FlopCounterMode``,
  the matmul peak, MFU (builds on ``memory.gpt``, ``memory.measure`` and
  ``models``).

Other people's models:

- ``llama``: a Llama-family model (RMSNorm, SwiGLU, RoPE with Llama 3's scaling,
  grouped-query attention, a KV cache, sampling) (builds on ``decoder``).
- ``hf_llama_config``: a Llama's config.json read into ``llama``'s config field
  by field (read, refused or ignored by name), and written back (builds on
  ``llama`` and ``state_dicts``).
- ``hf_checkpoint``: a Hugging Face model folder parsed, checked and loaded into
  ``llama``, and saved back as ``save_pretrained`` saves it (builds on
  ``hf_llama_config``, ``llama``, ``state_dicts`` and ``weights``).
- ``lora``: LoRA by hand: float32 adapters on frozen linear layers (bf16, or
  4-bit), merged, or saved in PEFT's format (builds on ``weights``).
- ``nf4``: NF4 by hand: the 16 levels, block-wise absmax, two codes per byte,
  double quantization of the scales; bitsandbytes' bytes on the CPU.
- ``qlora``: QLoRA's frozen base: ``NF4Linear``, stored in NF4 and computed in
  bf16, swapped in where ``BitsAndBytesConfig`` would (builds on ``nf4``).

Scripts a chapter launches (the kill-and-resume run, torchrun jobs) live in
examples/, outside the package.
"""
