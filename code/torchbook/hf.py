"""The book's tokenizer and chat template as Hugging Face ``transformers`` expects them.

``transformers`` models and trainers take a ``PreTrainedTokenizerFast`` and format
conversations with ``tokenizer.apply_chat_template(messages)``, which renders a Jinja
template stored in ``tokenizer.chat_template`` (which ``save_pretrained`` writes as
``chat_template.jinja`` in transformers 5). ``hf_tokenizer`` wraps a
``tokenizers.Tokenizer`` trained by ``torchbook.tokenizer`` and gives it a template
built from the same ``ChatTemplate`` strings that ``torchbook.chat.render_chat`` uses,
so both produce the same text for the same messages. It builds on
``torchbook.tokenizer`` and ``torchbook.chat``.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from torchbook.chat import ChatTemplate
from torchbook.tokenizer import ASSISTANT, END_OF_TEXT, PAD, USER


def jinja_chat_template(template: ChatTemplate = ChatTemplate()) -> str:
    """Jinja source rendering messages exactly as ``render_chat(messages, template)``.

    An unknown role raises inside the template (``raise_exception``), as
    ``render_chat`` refuses it; ``add_generation_prompt=True`` appends the
    assistant marker, the prompt a model completes at inference.
    """
    user, assistant, end = (
        json.dumps(part) for part in (template.user, template.assistant, template.end)
    )
    # One tag per line; "-" trims the newlines between tags, so only the {{ ... }}
    # output is rendered.
    return "\n".join(
        [
            "{%- for message in messages -%}",
            "{%- if message['role'] == 'user' -%}",
            f"{{{{ {user} + message['content'] + \"\\n\" }}}}",
            "{%- elif message['role'] == 'assistant' -%}",
            f"{{{{ {assistant} + message['content'] + {end} }}}}",
            "{%- else -%}",
            "{{ raise_exception('message ' ~ loop.index0 ~ ': role ' ~ "
            "message['role']) }}",
            "{%- endif -%}",
            "{%- endfor -%}",
            "{%- if add_generation_prompt -%}",
            f"{{{{ {assistant} }}}}",
            "{%- endif -%}",
        ]
    )


def hf_tokenizer(
    tokenizer: Tokenizer, template: ChatTemplate = ChatTemplate()
) -> PreTrainedTokenizerFast:
    """Wrap a trained tokenizer as a ``PreTrainedTokenizerFast`` with the chat template.

    The special tokens are the ones ``torchbook.tokenizer`` trains with; the
    ids are the same, since the wrapper calls the same Rust tokenizer.
    """
    missing = [
        t
        for t in (END_OF_TEXT, USER, ASSISTANT, PAD)
        if tokenizer.token_to_id(t) is None
    ]
    if missing:
        raise ValueError(
            f"tokenizer lacks the special token(s) {missing}; "
            "train it with torchbook.tokenizer.train_bpe"
        )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TEXT,
        pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT],
    )
    wrapped.chat_template = jinja_chat_template(template)
    return wrapped
