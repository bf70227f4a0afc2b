"""torchbook: the tested code behind *PyTorch Essentials for LLM Work*.

Each module stands alone so it can be copied into another project:

- ``profile``: the one place that picks the device and every run size.
- ``cache``: finds or downloads MNIST and Tiny Shakespeare, verified by SHA-256.
"""
