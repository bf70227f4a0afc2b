"""Tests for the byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, processors

from torchbook.tokenizer import (
    END_OF_TEXT,
    SPECIAL_TOKENS,
    TokenizerError,
    cached_tokenizer,
    encode_documents,
    encode_text,
    load_tokenizer,
    save_tokenizer,
    train_bpe,
)

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n"
) * 40


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "input.txt"
    path.write_text(TEXT)
    return path


def test_encoding_round_trips_any_text_including_unseen_bytes(text_file):
    tokenizer = train_bpe([text_file], vocab_size=300)
    for text in (TEXT[:200], "Zoë says ¡hola! 🎭"):
        assert tokenizer.decode(encode_text(tokenizer, text).tolist()) == text


def test_bpe_merges_make_fewer_tokens_than_bytes(text_file):
    tokenizer = train_bpe([text_file], vocab_size=300)
    assert len(encode_text(tokenizer, TEXT)) < len(TEXT.encode()) / 2


def test_special_tokens_take_the_first_ids(text_file):
    tokenizer = train_bpe([text_file], vocab_size=300)
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(
        range(len(SPECIAL_TOKENS))
    )


def test_saved_tokenizer_loads_and_encodes_the_same(text_file, tmp_path):
    tokenizer = train_bpe([text_file], vocab_size=300)
    loaded = load_tokenizer(save_tokenizer(tokenizer, tmp_path / "tokenizer.json"))
    assert loaded.encode(TEXT).ids == tokenizer.encode(TEXT).ids


def test_missing_tokenizer_file_is_named(tmp_path):
    with pytest.raises(
        TokenizerError, match=r"tokenizer\.json: tokenizer file is missing"
    ):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_vocabulary_smaller_than_the_bytes_is_refused(text_file):
    with pytest.raises(TokenizerError, match="at least 260"):
        train_bpe([text_file], vocab_size=100)


def test_empty_training_text_is_refused_naming_the_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(TokenizerError, match=r"empty\.txt: the training text is empty"):
        train_bpe([empty], vocab_size=300)


def test_no_training_files_is_refused():
    with pytest.raises(TokenizerError, match="no training text files"):
        train_bpe([], vocab_size=300)


def test_cached_tokenizer_is_reused_when_it_loads_and_matches(text_file, tmp_path):
    path = tmp_path / "tokenizer.json"
    first = cached_tokenizer(path, [text_file], vocab_size=300)
    saved = path.read_bytes()
    # training would fail: proves the saved file was used
    missing = tmp_path / "gone.txt"
    again = cached_tokenizer(path, [missing], vocab_size=300)
    assert again.encode(TEXT).ids == first.encode(TEXT).ids
    assert path.read_bytes() == saved


@pytest.mark.parametrize("damage", ["truncated", "other vocabulary"])
def test_cached_tokenizer_is_rebuilt_when_damaged_or_foreign(
    text_file, tmp_path, damage
):
    path = tmp_path / "tokenizer.json"
    if damage == "truncated":  # a write killed halfway
        save_tokenizer(train_bpe([text_file], vocab_size=300), path)
        path.write_bytes(path.read_bytes()[:100])
    else:
        save_tokenizer(train_bpe([text_file], vocab_size=280), path)
    tokenizer = cached_tokenizer(path, [text_file], vocab_size=300)
    assert tokenizer.get_vocab_size() == 300
    assert load_tokenizer(path).encode(TEXT).ids == tokenizer.encode(TEXT).ids


def test_training_on_bytes_that_are_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café crème, déjà vu\n".encode("latin-1") * 20)
    with pytest.raises(
        TokenizerError, match=r"latin1\.txt: training failed .*expected UTF-8 text"
    ):
        train_bpe([path], vocab_size=300)


@pytest.mark.parametrize("vocab_size", ["300", 300.0, 10])
def test_vocab_size_must_be_an_int_of_at_least_the_byte_alphabet(text_file, vocab_size):
    with pytest.raises(
        TokenizerError,
        match=rf"vocab_size={vocab_size!r}: a byte-level BPE needs an int",
    ):
        train_bpe([text_file], vocab_size=vocab_size)


DOCUMENTS = ["First Citizen:\nBefore we proceed.\n", "All:\nSpeak, speak.\n", "Zoë 🎭"]


def test_each_document_ends_with_end_of_text_as_a_template_appends_it(text_file):
    tokenizer = train_bpe([text_file], vocab_size=300)
    end_of_text = tokenizer.token_to_id(END_OF_TEXT)
    # the tokenizers library's own way to append a token to every encoding
    reference = Tokenizer.from_str(tokenizer.to_str())
    reference.post_processor = processors.TemplateProcessing(
        single=f"$A {END_OF_TEXT}", special_tokens=[(END_OF_TEXT, end_of_text)]
    )
    expected = [i for document in DOCUMENTS for i in reference.encode(document).ids]
    ids = encode_documents(tokenizer, DOCUMENTS)
    assert ids.tolist() == expected
    ends = [i for i, token in enumerate(ids.tolist()) if token == end_of_text]
    lengths = [len(encode_text(tokenizer, document)) + 1 for document in DOCUMENTS]
    assert ends == [sum(lengths[: n + 1]) - 1 for n in range(len(DOCUMENTS))]


def test_text_that_reads_end_of_text_does_not_end_a_document(text_file):
    tokenizer = train_bpe([text_file], vocab_size=300)
    end_of_text = tokenizer.token_to_id(END_OF_TEXT)
    document = f"a script that prints {END_OF_TEXT} and goes on"
    ids = encode_documents(tokenizer, [document]).tolist()
    assert ids.count(end_of_text) == 1 and ids[-1] == end_of_text
    assert tokenizer.decode(ids[:-1]) == document
    # the tokenizer's own setting is left as it was
    assert tokenizer.encode(END_OF_TEXT).ids == [end_of_text]


def test_one_string_is_refused_as_a_list_of_documents(text_file):
    tokenizer = train_bpe([text_file], vocab_size=300)
    with pytest.raises(TokenizerError, match="documents: expected strings"):
        encode_documents(tokenizer, "one long text")


def test_a_tokenizer_without_end_of_text_is_refused(text_file):
    tokenizer = train_bpe([text_file], vocab_size=300, special_tokens=["<|pad|>"])
    with pytest.raises(TokenizerError, match=r"has no <\|endoftext\|> token"):
        encode_documents(tokenizer, DOCUMENTS)
