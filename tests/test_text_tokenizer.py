"""The API process's tokenizer (tokenizers + jinja2, no transformers) against transformers' own, the oracle:
the same ids, the same text and the same rendered chat templates."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from pagedserve.engine.text.hf_tokenizer import load_tokenizer
from pagedserve.engine.text.text_tokenizer import TextTokenizer, TokenizerSpec

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "Ünïcödé, 日本語, emoji 🙂 and tabs\tand\nnewlines",
    "<|im_start|>user\nHi<|im_end|>",
    "Don't , stop . I 'm here ! Is it ? We 've and they 're",
    "",
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]
TEMPLATE = (
    "{% set ns = namespace(count=0) %}{% for m in messages %}{% set ns.count = ns.count + 1 %}"
    "{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>{% endgeneration %}"
    "{% else %}<{{ m.role }}>{{ m.content if m.content is string else m.content | map(attribute='text') | join }}"
    "{% endif %}{% if m.reasoning_content %}[{{ m.reasoning_content }}|{{ m.thinking }}]{% endif %}"
    "{% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}{% endfor %}"
    "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}{{ ns.count }}{{ bos_token }}{{ persona | default('') }}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


def spec_of(hf: Any) -> TokenizerSpec:
    spec = TokenizerSpec.of(hf)
    return pickle.loads(pickle.dumps(spec))  # it crosses to the API process pickled


@pytest.fixture(scope="module")
def smol(smol_dir: Path) -> Any:
    return load_tokenizer(smol_dir)


def wordpiece() -> Any:
    """A WordPiece tokenizer whose decoding cleans up spaces before punctuation (BERT's way)."""
    vocab = {token: i for i, token in enumerate(["[UNK]", "[SEP]", "don", "'", "t", ",", ".", "stop", "i", "m", "!"])}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    from tokenizers import decoders

    backend.decoder = decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]", clean_up_tokenization_spaces=True
    )


def with_bos(smol_dir: Path) -> Any:
    tokenizer = load_tokenizer(smol_dir)
    tokenizer.add_bos_token = True  # the post-processor adds a BOS, as Llama's tokenizers do
    return tokenizer


@pytest.mark.parametrize("kind", ["smol", "bos", "wordpiece"])
def test_encode_and_decode_as_transformers(kind: str, smol_dir: Path) -> None:
    hf = {"smol": lambda: load_tokenizer(smol_dir), "bos": lambda: with_bos(smol_dir), "wordpiece": wordpiece}[kind]()
    ours = TextTokenizer(spec_of(hf))
    for text in TEXTS:
        for add_special_tokens in (True, False):
            ids = hf.encode(text, add_special_tokens=add_special_tokens)
            assert ours.encode(text, add_special_tokens=add_special_tokens) == ids, (text, add_special_tokens)
            assert ours.decode(ids) == hf.decode(ids), text
            assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
            assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.eos_token_id == hf.eos_token_id and ours.special_tokens_map == hf.special_tokens_map
    assert ours.spec.clean_up_spaces == (kind == "wordpiece")


CONVERSATIONS: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "user", "content": "Hi"}], {"add_generation_prompt": True}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], {}),
    (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, "}],
        {"continue_final_message": True},
    ),
    (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ends in space "}],
        {"continue_final_message": True},
    ),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], {}),
    (
        [
            {"role": "user", "content": [{"type": "text", "text": "part"}]},
            {"role": "user", "content": [{"type": "text", "text": "go on"}]},
        ],
        {"continue_final_message": True},
    ),
    ([{"role": "assistant", "content": "x", "reasoning_content": "why", "tool_calls": None}], {}),
    ([{"role": "assistant", "content": "x", "reasoning": "old name", "name": None}], {}),
    (
        [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"é": "<b>"}}}]}],
        {},
    ),
    ([{"role": "user", "content": "Hi"}], {"tools": TOOLS, "persona": "a pirate"}),
]


@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("template", ["smol", "custom"])
def test_chat_templates_render_as_transformers(case: int, template: str, smol: Any, smol_dir: Path) -> None:
    hf = smol if template == "smol" else load_tokenizer(smol_dir)
    if template == "custom":
        hf.chat_template = TEMPLATE
    messages, options = CONVERSATIONS[case]
    ours = TextTokenizer(spec_of(hf))
    assert outcome(ours.apply_chat_template, messages, tokenize=False, **options) == outcome(
        hf.apply_chat_template, messages, tokenize=False, **options
    )
    expected = outcome(hf.apply_chat_template, messages, tokenize=True, return_dict=False, **options)
    assert outcome(ours.apply_chat_template, messages, **options) == expected


def outcome(render: Any, *args: Any, **kwargs: Any) -> Any:
    """What `render` returns, or the kind of error it raises (a template that cannot render the case)."""
    try:
        return render(*args, **kwargs)
    except Exception as exc:
        return type(exc)


def test_named_templates_pick_tool_use_for_tools(smol_dir: Path) -> None:
    hf = load_tokenizer(smol_dir)
    hf.chat_template = {"default": "plain {{ messages[0].content }}", "tool_use": "tools {{ tools | length }}"}
    ours = TextTokenizer(spec_of(hf))
    messages = [{"role": "user", "content": "Hi"}]
    for tools in (None, TOOLS):
        expected = hf.apply_chat_template(messages, tools=tools, tokenize=False)
        assert ours.apply_chat_template(messages, tools=tools, tokenize=False) == expected


def test_template_errors_are_jinja_errors_as_in_transformers(smol_dir: Path) -> None:
    import jinja2

    hf = load_tokenizer(smol_dir)
    hf.chat_template = "{{ raise_exception('no ' + messages[0].role) }}{{ ().__class__ }}"
    ours = TextTokenizer(spec_of(hf))
    with pytest.raises(jinja2.TemplateError, match="no user"):
        ours.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    sandboxed = TextTokenizer(spec_of(hf))
    sandboxed.chat_template = "{% set ns = namespace() %}{% set ns.__class__ = 1 %}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        sandboxed.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
