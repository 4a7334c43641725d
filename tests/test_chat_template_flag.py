"""--chat-template: a Jinja template (or a file holding one) used instead of the tokenizer's, in the prompt the
model sees, /tokenize, llama.cpp's /props and the offline API alike; anything else is refused at start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import transformers

from pagedserve import LLM
from pagedserve.engine import EngineConfig
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings
from tests.servers import served_engine

MODEL = "smol"
# Plain turns that no model's own template writes, so a prompt rendered with the tokenizer's would differ.
TEMPLATE = (
    "{%- for message in messages %}### {{ message.role | upper }}: {{ message.content }}\n{% endfor %}"
    "{%- if add_generation_prompt %}### ASSISTANT:{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def rendered_ids(smol_dir: Path) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smol_dir)
    text = tokenizer.apply_chat_template(MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False)
    assert text.endswith("### ASSISTANT:")
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "turns.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def url(smol_loaded: LoadedModel, template_file: Path) -> Iterator[str]:
    config = EngineConfig(num_kv_blocks=64, chat_template=str(template_file))
    with served_engine(config, smol_loaded, ServerSettings([MODEL])) as url:
        yield url


def test_a_file_an_inline_template_or_a_refusal(template_file: Path) -> None:
    assert EngineConfig(chat_template=str(template_file)).chat_template_text() == TEMPLATE
    assert EngineConfig(chat_template=TEMPLATE).chat_template_text() == TEMPLATE
    assert EngineConfig().chat_template_text() is None
    with pytest.raises(ValueError, match="chat_template must be a file or a Jinja template"):
        EngineConfig(chat_template=str(template_file.with_name("missing.jinja")))


def test_the_server_renders_chats_with_the_given_template(url: str, smol_dir: Path) -> None:
    expected = rendered_ids(smol_dir)
    tokens = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()["tokens"]
    assert tokens == expected
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens == len(expected)
    assert httpx.get(f"{url}/props").json()["chat_template"] == TEMPLATE


def test_the_offline_api_renders_with_it_too(smol_loaded: LoadedModel, smol_dir: Path) -> None:
    config = EngineConfig(num_kv_blocks=16, chat_template=TEMPLATE, engine_process=False)
    with LLM.from_config(config, smol_loaded) as llm:
        assert llm.encode_chat(MESSAGES) == rendered_ids(smol_dir)
