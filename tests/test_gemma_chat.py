"""Gemma's chat templates: Gemma 3's folds a system message into the first user turn; Gemma 2's refuses one, so
pagedserve folds it the same way and renders again."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from pagedserve.engine.text.tokenizer import apply_chat_template

# Gemma 2's template (google/gemma-2-2b-it), verbatim.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
# Gemma 3's (google/gemma-3-1b-it), its handling of the system message, for text contents.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = 'model' -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
CHAT = [
    {"role": "system", "content": "Answer in French."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Bonjour !"},
    {"role": "user", "content": "How are you?"},
]


def _tokenizer(smol_dir: Path, template: str) -> transformers.PreTrainedTokenizerBase:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smol_dir)
    tokenizer.chat_template = template
    return tokenizer


def test_gemma2_template_gets_the_system_message_as_gemma3_folds_it(smol_dir: Path) -> None:
    gemma2 = apply_chat_template(_tokenizer(smol_dir, GEMMA2_TEMPLATE), CHAT)
    assert gemma2 == apply_chat_template(_tokenizer(smol_dir, GEMMA3_TEMPLATE), CHAT)
    assert "<start_of_turn>user\nAnswer in French.\n\nHello!<end_of_turn>\n<start_of_turn>model\nBonjour !" in gemma2


def test_system_message_in_content_parts_is_folded_too(smol_dir: Path) -> None:
    parts = [{"type": "text", "text": "Answer in French."}]
    chat = [{"role": "system", "content": parts}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    template = GEMMA2_TEMPLATE.replace("message['content'] | trim", "message['content'] | map(attribute='text') | join")
    assert "<start_of_turn>user\nAnswer in French.\n\nHi<end_of_turn>" in apply_chat_template(
        _tokenizer(smol_dir, template), chat
    )


def test_a_refusal_folding_cannot_mend_is_still_reported(smol_dir: Path) -> None:
    tokenizer = _tokenizer(smol_dir, GEMMA2_TEMPLATE)
    with pytest.raises(ValueError, match="roles must alternate"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="System role not supported"):
        apply_chat_template(tokenizer, [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}])
