"""torchbook: the tested code behind *PyTorch Essentials for LLM Work*.

Each module reads on its own and can be copied into another project: it
imports only the libraries its topic needs and at most the package's three small
helpers, ``torchbook.device``, ``torchbook.profiles`` and ``torchbook.files``.
The few that build on another module say so below.

Helpers:

- ``device``: the precision dtypes, the accelerator, ``synchronize`` and ``timed``.
- ``profiles``: the one place that picks the device and every run size
  (``QUARTO_PROFILE``).
- ``files``: the one atomic writer (temporary, fsync, rename, fsync of the folder).

Chapters 1-5:

- ``download``: finds or downloads MNIST and Tiny Shakespeare, verified by SHA-256, and
  names the folder for derived files.
- ``models``: the small GPT (pre-norm, RoPE, SDPA, tied head; packed rows with
  per-document masks; optional activation checkpointing), the tutorial TinyMLP,
  parameter counting, ``check_token_ids``.
- ``optim``: the book's AdamW (decay and no-decay groups, fused where it can be), the
  warmup + cosine schedule, a changed config applied on resume, and the layout check of
  a saved optimizer state (groups, sizes, ``amsgrad``, moment shapes) that torch would
  load and then fail on.
- ``train``: the training loop (autocast, fp32 loss, token-normalised accumulation,
  scaler, clipping), ``StepResult``, the ``Trainer``'s
  ``state_dict``/``load_state_dict``, and the gradient arithmetic of DDP and FSDP2
  (builds on ``optim`` and ``state_dicts``).
- ``charlm``: chapter 3's character-level language model on Tiny Shakespeare as one
  experiment (builds on ``models`` and ``train``).
- ``plotting``: loss curves and training diagnostics from a history, memory per kind.
- ``diagrams``: pictures drawn from live objects: a tensor's storage and strides,
  broadcasting, a module tree with its parameters and buffers, one step under DDP or
  FSDP2; and ``show_error``, the one printer for the errors chapters provoke.
- ``shards``: token ids on disk as shards with a header, written atomically, checked
  before use, cached.
- ``data``: the tutorial ``TokenDataset`` and a streaming ``IterableDataset`` over
  shards, split across workers and ranks, resumable (builds on ``shards``).
- ``tokenizer``: a byte-level BPE tokenizer trained locally with ``tokenizers``.
- ``chat``: chat records into training examples (template, prompt masking, padding,
  packing with per-document masks) (builds on ``train`` for ``IGNORE_INDEX``).
- ``hf``: the tokenizer and chat template as a ``transformers`` tokenizer (builds on
  ``tokenizer`` and ``chat``).
- ``state_dicts``: a model's ``state_dict`` across ``torch.compile`` and DDP wrappers
  (the one unwrap of a module and of its keys) and the key/shape/dtype check to run
  before ``load_state_dict``.
- ``checkpoint``: exact resume: weights and the full training state
  (``Trainer.state_dict``, RNG including MPS, data position), atomic,
  ``weights_only``-safe, rotation by save sequence; parsed whole before anything changes
  (``TrainingCheckpoint``), with its trust model in its docstring (builds on
  ``state_dicts``).
- ``weights``: publishing: safetensors (tied weights as ``save_model`` stores them), a
  sharded index, loading on the ``meta`` device (builds on ``state_dicts``).

Chapters 6, 7 and 9, and the results of full-size runs:

- ``distributed``: process groups, rank slices, all-reduce counting and launching
  ``torchrun`` jobs that always end.
- ``memory``: where a GPT's training memory goes, predicted by formula: parameters,
  gradients, optimizer states, saved activations, logits, DDP buckets, the KV cache
  (precision, checkpointing, chunked loss, ZeRO/FSDP), and the calculator
  ``python -m torchbook.memory``, which the calculator answers for any model (builds on
  ``models`` and ``memory_calculator``).
- ``memory_configs``: a model's shape from a Hugging Face ``config.json`` (Llama,
  Mistral, Qwen2, GPT-2, the book's GPT and Llama) and its exact parameter count.
- ``memory_step``: what a ``transformers`` model's training step stores per rank, by
  precision, optimizer, LoRA, checkpointing, chunked loss and data parallelism
  (builds on ``memory_configs``).
- ``memory_peak``: that step's busiest moment, predicted (builds on ``memory_configs``
  and ``memory_step``).
- ``memory_calculator``: the command line behind ``python -m torchbook.memory``: each
  row in bytes and GB, the assumptions, whether it fits, ``--json`` (builds on
  ``memory``, ``memory_configs``, ``memory_peak`` and ``memory_step``).
- ``memory_check``: the same step of ``transformers``' own model, ``peft``'s LoRA model
  or FSDP2 over a fake process group, run on fake tensors with its peak tracked
  (builds on ``memory_configs``, ``memory_step`` and ``recompute``).
- ``memory_measure``: a step's memory measured without formulas: saved tensors, the
  peak, DDP's buckets (builds on ``train`` and ``memory``).
- ``recompute``: selective activation checkpointing with ``torch.utils.checkpoint``'s
  policy API (builds on ``models``).
- ``gpu_fit``: whether the book's GPU runs fit, predicted at the gpu profile's sizes
  (builds on ``memory``, ``models`` and ``charlm``).
- ``flops``: a GPT's training FLOPs per token from the formula and from
  ``FlopCounterMode``, the device's measured matmul peak, tokens per second and MFU
  (builds on ``models``, ``memory`` and ``memory_measure``).
- ``mnist``: MNIST read from its verified raw IDX files, as a dataset of PIL images and
  as resident tensors.
- ``lab``: what the lab's drills share: the MLP, its evaluation and MNIST as resident
  tensors, and the drills as runs for the GPU results (builds on ``mnist``, ``download``
  and ``optim``).
- ``drills``: the exercise notebook's checkers: they recompute from your objects
  (model, optimizer, generator, files), evaluate with the lab's own evaluation and
  repeat drill 4's big-batch steps themselves (builds on ``lab``).
- ``results``: results of full-size runs as JSON with provenance, and their staleness.
- ``dry_run``: the GPU job's own run functions at full size on fake tensors, without a
  GPU (``FakeRun``): values read from data stay real, values the model computes are
  placeholders, and the peak memory is tracked (builds on ``charlm``, ``gpu_fit``,
  ``lab``, ``memory``, ``memory_measure``, ``models`` and ``train``).

Chapter 8, other people's models:

- ``llama``: a Llama-family model (RMSNorm, SwiGLU, RoPE with ``rope_theta`` and Llama
  3's scaling, grouped-query attention, a KV cache of the key/value heads, sampling)
  (builds on ``models`` for RoPE's rotation and the token-id check).
- ``hf_checkpoint``: a Hugging Face model folder (``config.json``, sharded safetensors)
  parsed, checked and loaded into ``llama``, and saved back as a folder
  ``transformers`` loads (builds on ``llama``, ``weights`` and ``state_dicts``).
- ``lora``: LoRA by hand: adapters on frozen linear layers, merged, or saved in PEFT's
  format (builds on ``weights``).
- ``pretrained``: the stand-in "pretrained" checkpoint the build makes with
  ``transformers``, since it cannot download one (builds on ``hf`` and
  ``tokenizer``).

Scripts a chapter launches (the kill-and-resume run, the ``torchrun`` job,
``make gpu-results``) live in ``examples/``, outside the package.
"""
