"""Whether a run fits a GPU: one definition, in GiB, for the whole book.

A GPU's memory is built from chips whose sizes are powers of two, so a card
sold as "24 GB" or "80 GB" holds about 24 or 80 GiB, where a GiB is 2^30
bytes, 7% more than 10^9. A card is named here by its GiB.

A card of G GiB *fits* a run when the run's predicted peak is at most
``FIT_SHARE`` of G x 2^30 bytes. The rest is left for what no prediction of
this package counts, because its size is not known before the run or not
known at all: the CUDA context, cuBLAS's workspaces, NCCL's buffers, kernels'
scratch memory, and the caching allocator's cached and fragmented blocks
(PyTorch's CUDA notes: the allocator reserves more than the tensors it
holds). A fifth of the card is a margin, not a measurement: this book has not
measured those parts on a GPU. It imports nothing.
"""

from __future__ import annotations

GIB = 2**30  # bytes in a GiB
FIT_SHARE = 0.8  # of the card's memory a predicted peak may use
GPU_GIB = 80  # the cards readers rent for training: A100 and H100, 80 GB


def usable_bytes(gpu_gib: float) -> int:
    """Bytes of a ``gpu_gib`` GiB card that a run's predicted peak may use."""
    if not gpu_gib > 0:
        raise ValueError(f"a GPU's memory must be > 0 GiB, got {gpu_gib}")
    return int(FIT_SHARE * gpu_gib * GIB)


def fits(peak_bytes: int, gpu_gib: float) -> bool:
    """Whether a run whose predicted peak is ``peak_bytes`` fits a ``gpu_gib`` card."""
    return peak_bytes <= usable_bytes(gpu_gib)
