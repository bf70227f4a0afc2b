"""The fine-tuning chapter's task: is this line of Shakespeare a question?

Chapter 9 needs a task its stand-in checkpoint cannot know and whose answers
can be scored. ``question_chats`` makes one from Tiny Shakespeare: each chat
is a line of verse as the user's turn and ``"ask"`` or ``"tell"`` as the
assistant's answer: ``"ask"`` when the line ends with a question mark. The rule
is one a reader states in a sentence, but pretraining taught none of it: the
stand-in never saw a chat marker, nor a line followed by a verdict on it.

The lines are taken in the order of the text, so the same text always gives
the same chats, and as many questions as other lines, alternating: a model
that always answers "tell" (most lines are not questions) scores one half, so a
score above that is the rule learned, not the commoner answer.
"""

from __future__ import annotations

QUESTION, OTHER = "ask", "tell"  # does the line ask, or tell?
END_MARKS = ".,:;?!"  # a line counts if it ends with one of these
MIN_WORDS, MAX_WORDS = 3, 10  # short lines: a speaker's name or a long speech out


def verse_lines(text: str) -> list[str]:
    """The lines of ``text``, stripped, that end with a mark and have 3 to 10 words."""
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if line and line[-1] in END_MARKS:
            if MIN_WORDS <= len(line.split()) <= MAX_WORDS:
                lines.append(line)
    return lines


def question_chats(text: str, per_answer: int) -> list[dict]:
    """``2 * per_answer`` chats from ``text``: a question, another line, alternating.

    Each is ``{"messages": [user: the line, assistant: "ask" or "tell"]}``, the
    layout of ``HuggingFaceH4/ultrachat_200k``. A ``ValueError`` says how many
    lines of each kind the text has when it has fewer than ``per_answer``.
    """
    lines = verse_lines(text)
    questions = [line for line in lines if line.endswith("?")]
    others = [line for line in lines if not line.endswith("?")]
    if min(len(questions), len(others)) < per_answer:
        raise ValueError(
            f"question_chats: per_answer={per_answer}, but the text has "
            f"{len(questions)} questions and {len(others)} other lines of "
            f"{MIN_WORDS} to {MAX_WORDS} words"
        )
    chats = []
    pairs = zip(questions[:per_answer], others[:per_answer], strict=True)
    for question, other in pairs:
        for line, answer in ((question, QUESTION), (other, OTHER)):
            messages = [
                {"role": "user", "content": line},
                {"role": "assistant", "content": answer},
            ]
            chats.append({"messages": messages})
    return chats
