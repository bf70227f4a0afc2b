"""DDP in one file: a byte-level bigram model on a text file, one process per device.

torchrun --nproc-per-node=2 examples/ddp_minimal.py TEXT_FILE OUT_FILE
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BLOCK, BATCH, EPOCHS, LR = 64, 32, 2, 0.05


def main(text_file: str, out_file: str) -> str:
    """Train on ``text_file``, save the weights to ``out_file``; return the backend."""
    # torchrun sets it: this process's index on its machine
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    device = (
        torch.device("cuda", local_rank)
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend)  # RANK, WORLD_SIZE from torchrun
    data = torch.frombuffer(
        bytearray(open(text_file, "rb").read()), dtype=torch.uint8
    ).long()
    blocks = data[: len(data) // (BLOCK + 1) * (BLOCK + 1)].view(-1, BLOCK + 1)
    # every rank its own share
    sampler = DistributedSampler(TensorDataset(blocks), shuffle=True, seed=0)
    loader = DataLoader(
        TensorDataset(blocks), batch_size=BATCH, sampler=sampler, drop_last=True
    )
    torch.manual_seed(0)
    # logits for the next byte, from this byte
    model = DDP(torch.nn.Embedding(256, 256).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for epoch in range(EPOCHS):
        # a new shuffle each epoch; without it every epoch repeats the first
        sampler.set_epoch(epoch)
        for (block,) in loader:
            x, y = block[:, :-1].to(device), block[:, 1:].to(device)
            tokens = torch.tensor(y.numel(), device=device)
            # the global token count: every rank divides by the same number
            dist.all_reduce(tokens)
            loss = (
                F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
                / tokens
            )
            optimizer.zero_grad()
            # DDP averages gradients; times world size = sum
            (loss * dist.get_world_size()).backward()
            optimizer.step()
        last_loss = loss.detach()
        # the last batch's global mean loss: the sum of the ranks' shares
        dist.all_reduce(last_loss)
        if dist.get_rank() == 0:
            ranks = dist.get_world_size()
            print(f"epoch {epoch}: loss {last_loss.item():.3f} on {ranks} ranks")
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), out_file)
    dist.barrier()  # rank 0 has written the weights: every rank can leave
    dist.destroy_process_group()
    return backend


if __name__ == "__main__":
    if main(*sys.argv[1:]) == "gloo":
        # Once DDP has used a gloo process group, gloo's threads outlive
        # destroy_process_group (torch 2.14), and a normal exit aborts now and then
        # in their teardown (SIGABRT, after all the work). Leave without it. Only for
        # gloo: os._exit also skips atexit handlers (logging, trackers) and buffers.
        sys.stdout.flush()
        os._exit(0)
