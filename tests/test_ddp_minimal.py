"""examples/ddp_minimal.py, the one-file DDP recipe chapter 6 shows, trains as shown."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from torchbook.book.download import shakespeare_path
from torchbook.book.profiles import active_profile
from torchbook.distributed import launch, torchrun_command

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ddp_minimal_trains_a_bigram_model_on_two_ranks(tmp_path):
    text = tmp_path / "start.txt"
    sizes = active_profile().devices
    text.write_bytes(shakespeare_path().read_bytes()[: sizes.minimal_text_bytes])
    output = launch(
        torchrun_command(
            ROOT / "examples" / "ddp_minimal.py", [text, tmp_path / "weights.pt"]
        ),
        timeout_s=sizes.launch_timeout_s,
        cwd=ROOT,
    )
    epochs = [line for line in output.splitlines() if line.startswith("epoch")]
    assert len(epochs) == 2 and all("on 2 ranks" in line for line in epochs), output
    losses = [float(line.split("loss ")[1].split()[0]) for line in epochs]
    # a uniform guess over 256 byte values costs ln 256; a bigram of English bytes
    # learns far below it within an epoch
    assert max(losses) < 0.6 * math.log(256), losses
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    torch.nn.Embedding(256, 256).load_state_dict(weights)  # strict: the saved model
