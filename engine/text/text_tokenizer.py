"""The tokenizer of the API process, from the `tokenizers` library and jinja2 alone.

The engine core loads the model's tokenizer with transformers (which imports torch) and describes it in a
TokenizerSpec: the tokenizers library's JSON as transformers configured it (its BOS/EOS post-processor
included), the chat templates, the special tokens and how decoding cleans up spaces. The caller's side builds a
TextTokenizer from that description: encoding, decoding and chat templates as transformers' own, with neither
transformers nor torch imported. This module never imports either; a transformers tokenizer is read by duck typing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenizers import AddedToken, Tokenizer

from pagedserve.engine.text.chat_template import ChatTemplates, render_chat, select_template

CLEAN_UP_PROBE = "Hello , world . I 'm sure it 's so ! Is it ? We 've and they 're , don n't"


class FastTokenizer(Protocol):
    """What the engine reads of a tokenizer beyond the text API: transformers' fast tokenizers and TextTokenizer."""

    @property
    def backend_tokenizer(self) -> Tokenizer: ...

    @property
    def eos_token_id(self) -> int | None: ...


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as plain, picklable data: what the core tells its callers once it has loaded."""

    backend_json: str  # the tokenizers library's JSON, without padding or truncation
    chat_template: ChatTemplates | None
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: the names a chat template reads them by
    clean_up_spaces: bool  # decode() joins " ," into ",", ... (WordPiece tokenizers)
    eos_token_id: int | None
    model_max_length: int
    class_name: str = "TokenizersBackend"
    config: dict[str, Any] = field(default_factory=dict)  # the tokenizer's configuration, as JSON (its info)

    @classmethod
    def of(cls, tokenizer: Any, backend_json: str | None = None) -> TokenizerSpec:
        """The spec of a transformers fast tokenizer; `backend_json` where its serialization is at hand already
        (structured.lltokenizer keeps one: serializing a large vocabulary takes most of a second)."""
        backend: Tokenizer = tokenizer.backend_tokenizer
        if backend_json is None:
            unpadded = Tokenizer.from_str(backend.to_str())
            unpadded.no_padding()
            unpadded.no_truncation()
            backend_json = unpadded.to_str()
        probe = backend.encode(CLEAN_UP_PROBE, add_special_tokens=False).ids
        config = {k: v for k, v in tokenizer.init_kwargs.items() if not k.endswith(("_file", "name_or_path"))}
        return cls(
            backend_json=backend_json,
            chat_template=tokenizer.chat_template,
            special_tokens=dict(tokenizer.special_tokens_map),
            clean_up_spaces=tokenizer.decode(probe) != backend.decode(probe, skip_special_tokens=False),
            eos_token_id=tokenizer.eos_token_id,
            model_max_length=int(tokenizer.model_max_length),
            class_name=type(tokenizer).__name__,
            config=json_safe(config),
        )


class TextTokenizer:
    """Encoding, decoding and chat templates of a TokenizerSpec, with the names transformers' tokenizers use
    (a caller of the offline API reads it as one). Thread-safe: the library encodes on many threads at once."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self.backend_tokenizer = Tokenizer.from_str(spec.backend_json)
        self.chat_template = spec.chat_template
        self.special_tokens_map = dict(spec.special_tokens)
        self.eos_token_id = spec.eos_token_id
        self.model_max_length = spec.model_max_length
        self.init_kwargs = dict(spec.config)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.spec.clean_up_spaces else text

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str | None]:
        return [self.backend_tokenizer.id_to_token(token_id) for token_id in token_ids]

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int | None]:
        return [self.backend_tokenizer.token_to_id(token) for token in tokens]

    def get_chat_template(self, tools: list[dict[str, Any]] | None = None) -> str:
        return select_template(self.chat_template, tools)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """As transformers' (one conversation): the prompt's text, or with `tokenize` its ids (no special tokens
        added: the template places them)."""
        text = render_chat(
            self.get_chat_template(tools),
            conversation,
            tools,
            add_generation_prompt,
            continue_final_message,
            **{**self.special_tokens_map, **template_kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of the spaces WordPiece's decoding leaves before punctuation and contractions."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(spaced, joined)
    for spaced, joined in ((" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


def json_safe(value: Any) -> Any:
    """`value` as JSON holds it: containers walked, anything else that is not a JSON scalar as its text."""
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
