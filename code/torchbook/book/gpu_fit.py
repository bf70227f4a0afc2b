"""Will the book's GPU runs fit? Each run's peak predicted at the gpu profile's sizes.

No GPU is needed to ask: ``torchbook.memory.gpt`` predicts from the shapes that
``torchbook.book.profiles`` gives the gpu profile, and ``torchbook.memory.fit``
says whether a peak fits a card. Chapter 7 prints ``fit_table``. It builds on
``torchbook.memory`` (the step's description), ``torchbook.memory.gpt`` (the
prediction), ``torchbook.memory.fit``, ``torchbook.models`` (``GPTConfig``),
``torchbook.book.profiles`` (the sizes) and ``torchbook.book.charlm`` (chapter
3's model, configured once).
"""

from __future__ import annotations

from itertools import pairwise

from torchbook.book.charlm import model_config
from torchbook.book.profiles import gpu_sizes, make_profile
from torchbook.memory import FP32, TrainingSetup
from torchbook.memory.fit import GIB, GPU_GIB
from torchbook.memory.gpt import predict_peak
from torchbook.models import GPTConfig

CHAR_VOCAB = 256  # character-level models: at most 256 symbols (Tiny Shakespeare: 65)


def mlp_peak(widths: tuple[int, ...], batch_size: int) -> int:
    """Upper bound on an MLP's training peak, in bytes.

    16 bytes per parameter, and every layer's input and output kept.
    """
    parameters = sum(a * b + b for a, b in pairwise(widths))
    return 4 * FP32 * parameters + 2 * FP32 * batch_size * sum(widths)


def gpu_run_peaks() -> dict[str, int]:
    """Predicted peak bytes of each run the book makes at gpu-profile sizes, on CUDA.

    CUDA's kernels: ``TrainingSetup``'s default.

    The runs use bf16 autocast except chapter 7's float32 cells, which are
    predicted at their largest: the longest context in the tutorial loop.
    """
    cpu = make_profile("cpu")
    lm, device, demo, memory, lab = (
        gpu_sizes(sizes)
        for sizes in (cpu.lm, cpu.devices, cpu.checkpoint, cpu.memory, cpu.lab)
    )
    longest = max(memory.seq_lens)
    chapter_7 = GPTConfig(
        memory.vocab_size, longest, memory.n_layer, memory.n_head, memory.d_model
    )
    runs = {
        "ch. 3 language model (and the compile results)": (
            model_config(CHAR_VOCAB, lm),
            TrainingSetup(lm.batch_size, lm.block_size, "bf16"),
        ),
        "ch. 5 loading demo (as if trained on its 2 x 16 input)": (
            GPTConfig(
                demo.demo_vocab_size,
                demo.demo_block_size,
                demo.demo_n_layer,
                demo.demo_n_head,
                demo.demo_d_model,
            ),
            TrainingSetup(2, 16, "bf16"),
        ),
        "ch. 6 torch.compile model": (
            GPTConfig(
                device.vocab_size,
                device.compile_block_size,
                device.compile_n_layer,
                device.n_head,
                device.compile_d_model,
            ),
            TrainingSetup(device.compile_batch_size, device.compile_block_size, "bf16"),
        ),
    }
    for precision in ("fp32", "bf16"):
        runs[f"ch. 7 {precision} cells (largest: tutorial loop)"] = (
            chapter_7,
            TrainingSetup(memory.batch_size, longest, precision, loop="tutorial"),
        )
    peaks = {name: predict_peak(*run) for name, run in runs.items()}
    peaks["ch. 10 lab MLP"] = mlp_peak((28 * 28, *lab.hidden, 10), lab.batch_size)
    return peaks


def fit_table(gpu_gib: float = GPU_GIB) -> str:
    """A text table of each GPU run's predicted peak against a ``gpu_gib`` GiB GPU."""
    card = f"of {gpu_gib:g} GiB"
    lines = [f"{'run (gpu profile)':52s}{'predicted peak':>16s}{card:>12s}"]
    for name, peak in gpu_run_peaks().items():
        share = peak / (gpu_gib * GIB)
        lines.append(f"{name:52s}{peak / GIB:>12.3f} GiB{share:>12.1%}")
    return "\n".join(lines)
