"""Turn chat records into fine-tuning examples: template, masking, padding or packing.

A chat record is ``{"messages": [{"role": "user", "content": ...},
{"role": "assistant", "content": ...}, ...]}``, the layout of
``HuggingFaceH4/ultrachat_200k``. Fine-tuning learns only the assistant's
words: every token of the template and of the user's turns gets the label
``IGNORE_INDEX`` (-100), which ``torch.nn.functional.cross_entropy`` skips.
Labels sit on the same positions as ``input_ids`` (Hugging Face's convention);
shift by one when computing the loss: ``x = input_ids[:, :-1]``,
``y = labels[:, 1:]``.

Two ways to batch examples of different lengths:

- ``PadCollate`` pads each batch to its longest example, on the right, with
  label -100 on the pads. A causal model's token attends only to earlier
  tokens, so with the pads after the real ones no real token sees a pad and no
  attention mask is needed.
- ``pack_documents`` places whole examples side by side in rows and says
  where each one lies (``position_ids`` restarting at 0, ``document_ids``), so
  a model that masks attention per document (``Llama.forward(idx,
  position_ids=..., document_ids=...)``) computes each example as if it were
  alone. Concatenating examples and cutting fixed blocks wastes no position
  either, but without such a mask attention crosses from one conversation into
  the next.

``greedy_answers_correct`` scores a fine-tune: which examples greedy decoding
answers exactly, from one forward pass over their packed rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# The label the loss skips: cross_entropy's default ignore_index. A prompt token, a pad
# and a packed document's last token get it; the training loop imports it from here.
IGNORE_INDEX = -100
ROLES = ("user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    """The strings around each turn.

    Each role opens with its marker; the assistant's turn ends with ``end``.
    """

    user: str = "<|user|>\n"
    assistant: str = "<|assistant|>\n"
    end: str = "<|endoftext|>\n"


def render_chat(
    messages: Sequence[dict], template: ChatTemplate = ChatTemplate()
) -> str:
    """The whole conversation as one string, as the model reads it."""
    parts = []
    for number, turn in enumerate(messages):
        if turn.get("role") == "user":
            parts.append(template.user + turn["content"] + "\n")
        elif turn.get("role") == "assistant":
            parts.append(template.assistant + turn["content"] + template.end)
        else:
            raise ValueError(
                f"message {number}: role {turn.get('role')!r}, expected one of {ROLES}"
            )
    return "".join(parts)


def chat_example(
    messages: Sequence[dict],
    encode: Callable[[str], list[int]],
    template: ChatTemplate = ChatTemplate(),
) -> dict[str, list[int]]:
    """Templated ``input_ids`` and ``labels`` that are -100 except on assistant answers.

    Each piece is encoded on its own and the ids concatenated, so the boundary
    between prompt and answer is exact (encoding the joined string could merge
    tokens across it). The assistant's answer and its end marker are learned;
    the role marker before it is not, since the template supplies it.
    """
    input_ids: list[int] = []
    labels: list[int] = []
    for number, turn in enumerate(messages):
        role = turn.get("role")
        if role not in ROLES:
            raise ValueError(
                f"message {number}: role {role!r}, expected one of {ROLES}"
            )
        if role == "user":
            ids = encode(template.user + turn["content"] + "\n")
            input_ids += ids
            labels += [IGNORE_INDEX] * len(ids)
        else:
            marker = encode(template.assistant)
            answer = encode(turn["content"] + template.end)
            input_ids += marker + answer
            labels += [IGNORE_INDEX] * len(marker) + answer
    return {"input_ids": input_ids, "labels": labels}


class PadCollate:
    """Collate examples into ``input_ids`` and ``labels``, padded on the right.

    No ``attention_mask``: every pad comes after the real tokens of its row,
    and a causal model's token sees only the tokens before it, so the real
    tokens compute what they would alone and the pads' outputs carry label
    -100. (Left padding, which batched generation uses, puts pads before real
    tokens and does need a mask; ``transformers``' collators return one, and
    its models read it.) A class, so DataLoader workers can pickle it.
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        length = max(len(e["input_ids"]) for e in examples)
        batch = len(examples)
        input_ids = torch.full((batch, length), self.pad_id, dtype=torch.long)
        labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
        for row, example in enumerate(examples):
            n = len(example["input_ids"])
            input_ids[row, :n] = torch.as_tensor(example["input_ids"])
            labels[row, :n] = torch.as_tensor(example["labels"])
        return {"input_ids": input_ids, "labels": labels}


def pack_documents(
    examples: Sequence[dict], row_length: int, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """Pack whole examples into rows of ``row_length`` tokens (first fit, in order).

    Returns (rows, row_length) tensors: ``tokens``; ``targets``, the label of the
    next token of the same example, so ``cross_entropy(logits, targets)`` needs
    no shift, and IGNORE_INDEX at each example's last token, whose next token
    belongs to another example; ``position_ids``, restarting at 0 in each
    example; ``document_ids``, the example's index in ``examples``, and -1 on
    the padding that ends a row no example fits into.

    With RoPE and the document mask, positions that run on across the row give
    the same losses up to rounding (a query-key score depends only on the
    distance between the two positions). Restarting them is still the
    convention: learned absolute position embeddings (GPT-2) need it, and
    Hugging Face's padding-free training finds document boundaries from
    ``position_ids`` that restart at 0.
    """
    rows: list[list[int]] = []  # indices of the examples in each row
    free: list[int] = []  # tokens still free in each row
    for index, example in enumerate(examples):
        length = len(example["input_ids"])
        if length == 0:
            raise ValueError(f"example {index} has no tokens; drop it before packing")
        if length > row_length:
            raise ValueError(
                f"example {index} has {length} tokens, more than "
                f"row_length={row_length}; split or truncate it first, or make "
                "rows longer"
            )
        row = next((r for r, space in enumerate(free) if space >= length), len(rows))
        if row == len(rows):
            rows.append([])
            free.append(row_length)
        rows[row].append(index)
        free[row] -= length

    shape = (len(rows), row_length)
    tokens = torch.full(shape, pad_id, dtype=torch.long)
    targets = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    document_ids = torch.full(shape, -1, dtype=torch.long)
    for row, indices in enumerate(rows):
        start = 0
        for index in indices:
            ids, labels = examples[index]["input_ids"], examples[index]["labels"]
            end = start + len(ids)
            tokens[row, start:end] = torch.as_tensor(ids)
            targets[row, start : end - 1] = torch.as_tensor(labels[1:])
            position_ids[row, start:end] = torch.arange(len(ids))
            document_ids[row, start:end] = index
            start = end
        # the padding reads as one more document
        position_ids[row, start:] = torch.arange(row_length - start)
    return {
        "tokens": tokens,
        "targets": targets,
        "position_ids": position_ids,
        "document_ids": document_ids,
    }


def greedy_answers_correct(
    logits: torch.Tensor, targets: torch.Tensor, document_ids: torch.Tensor
) -> torch.Tensor:
    """Whether greedy decoding reproduces each packed example's learned tokens.

    ``logits`` (rows, row_length, vocab) come from one forward pass over the
    rows ``pack_documents`` made, whose ``targets`` and ``document_ids`` are
    given. At each position the model has the example's true tokens before
    it, so the most likely token there is the one greedy decoding picks if it
    got every earlier token right: an example whose every learned target is
    its position's most likely token is one that greedy decoding answers
    exactly, end marker included. Returns one bool per example.
    """
    learned = targets != IGNORE_INDEX
    wrong = learned & (logits.argmax(dim=-1) != targets)
    n_examples = int(document_ids.max()) + 1
    wrong_per_example = torch.zeros(n_examples, dtype=torch.long, device=wrong.device)
    wrong_per_example.index_add_(0, document_ids[learned], wrong[learned].long())
    return wrong_per_example == 0
