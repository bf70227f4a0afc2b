"""The fine-tuning chapter's task: a line of verse, and whether it is a question."""

from __future__ import annotations

import pytest

from torchbook.book.questions import OTHER, QUESTION, question_chats, verse_lines

TEXT = """First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak.

First Citizen:
You are all resolved rather to die than to famish?
What say you to the famous Caius Marcius?
We know't, we know't
Is it not a question without a mark
Let us kill him, and we'll have corn.
Why, then, should we not be patient and go home?
"""


def test_verse_lines_keep_lines_of_3_to_10_words_that_end_with_a_mark():
    assert verse_lines(TEXT) == [
        "Before we proceed any further, hear me speak.",
        "You are all resolved rather to die than to famish?",
        "What say you to the famous Caius Marcius?",
        "Let us kill him, and we'll have corn.",
        "Why, then, should we not be patient and go home?",
    ]


def test_question_chats_alternate_questions_and_other_lines_in_text_order():
    chats = question_chats(TEXT, per_answer=2)
    pairs = [
        (chat["messages"][0]["content"], chat["messages"][1]["content"])
        for chat in chats
    ]
    assert pairs == [
        ("You are all resolved rather to die than to famish?", QUESTION),
        ("Before we proceed any further, hear me speak.", OTHER),
        ("What say you to the famous Caius Marcius?", QUESTION),
        ("Let us kill him, and we'll have corn.", OTHER),
    ]
    assert all(
        [m["role"] for m in chat["messages"]] == ["user", "assistant"] for chat in chats
    )


def test_question_chats_refuse_more_than_the_text_has_naming_the_counts():
    with pytest.raises(ValueError, match="3 questions and 2 other lines"):
        question_chats(TEXT, per_answer=3)
