"""torchbook: the tested code behind *PyTorch Essentials for LLM Work*.

Each module stands alone so it can be copied into another project; it imports
only the libraries its topic needs and at most ``torchbook.profile``:

- ``profile``: the one place that picks the device and every run size (``QUARTO_PROFILE``).
- ``cache``: finds or downloads MNIST and Tiny Shakespeare, verified by SHA-256, and
  names the folder for derived files.
- ``models``: the small GPT (pre-norm, RoPE, SDPA, tied head), the seed's TinyMLP,
  parameter counting.
- ``train``: the training loop (autocast, fp32 loss, accumulation, scaler, clipping,
  warmup + cosine schedule, history).
- ``plotting``: loss curves from a training history.
- ``data``: token shards on disk and a streaming ``IterableDataset`` over them,
  split across workers and ranks, resumable.
- ``tokenizer``: a byte-level BPE tokenizer trained locally with ``tokenizers``.
- ``chat``: chat records into training examples (template, prompt masking, padding, packing).
- ``mnist``: MNIST through torchvision and as resident tensors.
- ``checkpoint``: weights and full training state, atomic and ``weights_only``-safe;
  safetensors (tied and sharded); loading on the ``meta`` device.
- ``resume_demo``: the kill-and-resume run that proves exact resume
  (``python -m torchbook.resume_demo``).
"""
