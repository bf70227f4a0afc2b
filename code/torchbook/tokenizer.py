"""Train, save and load a byte-level BPE tokenizer with Hugging Face ``tokenizers``.

Byte-level means the base alphabet is the 256 byte values, so any text
encodes without an unknown token; BPE then merges frequent pairs until the
vocabulary reaches ``vocab_size``. Training on Tiny Shakespeare takes about a
second, so the book trains its own instead of downloading one, and saves it
as ``tokenizer.json`` beside the shards it produced. ``encode_documents`` turns a
corpus into the ids shards hold: each document followed by ``<|endoftext|>``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from torchbook.files import atomic_write_text

# Special tokens get the first ids: the end of a document, the two chat roles, padding.
END_OF_TEXT = "<|endoftext|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (END_OF_TEXT, USER, ASSISTANT, PAD)


class TokenizerError(ValueError):
    """A tokenizer file is missing or unusable."""


def train_bpe(
    text_files: Sequence[Path | str],
    vocab_size: int,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer of ``vocab_size`` ids on ``text_files``."""
    minimum = 256 + len(special_tokens)  # every byte plus the special tokens
    if type(vocab_size) is not int or vocab_size < minimum:
        raise TokenizerError(
            f"vocab_size={vocab_size!r}: "
            f"a byte-level BPE needs an int of at least {minimum} ids"
        )
    if not text_files:
        raise TokenizerError("train_bpe: no training text files given")
    for path in text_files:
        if not Path(path).is_file():
            raise TokenizerError(f"{path}: training text is missing")
    names = ", ".join(str(p) for p in text_files)
    if all(Path(path).stat().st_size == 0 for path in text_files):
        raise TokenizerError(
            f"{names}: the training text is empty; BPE would learn no merges from it"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    try:
        tokenizer.train([str(p) for p in text_files], trainer)
    # tokenizers raises a bare Exception, e.g. for bytes that are not UTF-8
    except Exception as error:
        raise TokenizerError(
            f"{names}: training failed ({error}); expected UTF-8 text files"
        ) from error
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, path: Path | str) -> Path:
    """Save ``tokenizer`` atomically as one JSON file: vocabulary, merges, settings."""
    return atomic_write_text(path, tokenizer.to_str())


def load_tokenizer(path: Path | str) -> Tokenizer:
    """Load a ``save_tokenizer`` file, naming the file if it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(
            f"{path}: tokenizer file is missing; "
            "train one with train_bpe and save_tokenizer"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for malformed JSON
        raise TokenizerError(f"{path}: not a tokenizers JSON file ({error})") from error


def cached_tokenizer(
    path: Path | str, text_files: Sequence[Path | str], vocab_size: int
) -> Tokenizer:
    """The tokenizer at ``path`` if it has ``vocab_size`` ids; else train and save one.

    A derived file is trusted only after it loads and matches the request, so a
    damaged or foreign ``tokenizer.json`` is replaced instead of used.
    """
    try:
        tokenizer = load_tokenizer(path)
        if tokenizer.get_vocab_size() == vocab_size:
            return tokenizer
    except TokenizerError:
        pass
    tokenizer = train_bpe(text_files, vocab_size)
    save_tokenizer(tokenizer, path)
    return tokenizer


def encode_text(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """Token ids of ``text`` as an int64 array."""
    return np.asarray(tokenizer.encode(text).ids, dtype=np.int64)


def encode_documents(tokenizer: Tokenizer, documents: Iterable[str]) -> np.ndarray:
    """Token ids of ``documents`` one after another, each followed by ``END_OF_TEXT``.

    Pretraining cuts blocks that run from one document into the next; the token marks
    where one ends, so the model learns to predict an end and sees, before an unrelated
    text begins, that it is unrelated (GPT-3's data and nanoGPT's preparation do the
    same). A document whose text reads ``<|endoftext|>`` is encoded as that text, not
    as the marker, as nanoGPT's ``encode_ordinary`` does.
    """
    end_of_text = tokenizer.token_to_id(END_OF_TEXT)
    if end_of_text is None:
        raise TokenizerError(
            f"the tokenizer has no {END_OF_TEXT} token to end each document with; "
            "train it with that token among its special_tokens"
        )
    if isinstance(documents, str):
        raise TokenizerError(
            f"documents: expected strings, one per document, got one str of "
            f"{len(documents):,} characters; pass [text] for a single document"
        )
    ids: list[int] = []
    special_as_text = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True  # a marker inside a text is text
    try:
        for document in documents:
            ids += tokenizer.encode(document).ids
            ids.append(end_of_text)
    finally:
        tokenizer.encode_special_tokens = special_as_text
    return np.asarray(ids, dtype=np.int64)
