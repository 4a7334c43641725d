"""The chat and status page at `/`: served from the package, driven in headless Chromium against a real server."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.engine import EngineConfig
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings, create_app
from pagedserve.server.cli import build_parser
from tests.background import BackgroundServer
from tests.browser import Browser, require_chromium
from tests.servers import engine_and_url, running_engine, serving

MODEL = "smol"
WEB = Path(__file__).resolve().parents[1] / "server" / "web"
LAST_REPLY = "[...document.querySelectorAll('.message.assistant')].at(-1)"
# Enough tokens to be still streaming when a test acts on it; every such test stops it.
LONG_REPLY = {"max-tokens": "600", "extra": '{"ignore_eos": true}'}


engine, url = engine_and_url(EngineConfig(num_kv_blocks=256, max_num_seqs=4), ServerSettings([MODEL]))


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with Browser(require_chromium()) as browser:
        yield browser


def metrics(url: str) -> dict[str, float]:
    """/metrics' samples by name and labels, e.g. 'pagedserve:num_requests_running{model_name="smol"}'."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {name: float(value) for name, value in re.findall(r"^(\S+) (\S+)$", text, re.MULTILINE)}


def metric(url: str, name: str, **labels: str) -> float:
    tags = ",".join(f'{key}="{value}"' for key, value in sorted({"model_name": MODEL, **labels}.items()))
    return metrics(url).get(f"pagedserve:{name}{{{tags}}}", 0.0)


def open_chat(browser: Browser, url: str, **fields: str) -> None:
    """Loads the page afresh (no saved settings) and fills the chat's settings: field id -> value."""
    browser.goto(url)
    browser.evaluate("localStorage.clear()")
    browser.goto(url)
    browser.wait_for("document.getElementById('model').textContent.includes('context')")
    for field, value in {"temperature": "0", **fields}.items():
        browser.fill(f"#{field}", value)


def send(browser: Browser, message: str) -> None:
    browser.fill("#prompt", message)
    browser.click("#send")
    browser.wait_for(f"{LAST_REPLY}?.dataset.state")


def reply_part(browser: Browser, selector: str) -> str:
    """The text of a part of the last reply."""
    return browser.evaluate(f"{LAST_REPLY}.querySelector({json.dumps(selector)}).textContent")


def wait_streaming(browser: Browser) -> None:
    body = f"{LAST_REPLY}.querySelector('.body')"
    browser.wait_for(f"{LAST_REPLY}.dataset.state === 'streaming' && {body}.textContent.trim().length > 0")


def wait_until_idle(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(url, "num_requests_running") or metric(url, "num_requests_waiting"):
        assert time.monotonic() < deadline, "requests still running after the page stopped them"
        time.sleep(0.1)


# ---- served files ----------------------------------------------------------------------------------------


def test_the_page_and_its_files_are_served_with_relative_urls(url: str) -> None:
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<base" not in page.text  # no root path: the page's URLs stay relative to wherever it is
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name in sorted(path.name for path in WEB.iterdir() if path.name != "index.html"):
        answer = httpx.get(f"{url}/web/{name}")
        assert answer.status_code == 200 and answer.content == (WEB / name).read_bytes(), name
        # An absolute URL would miss a proxy's prefix.
        assert not re.search(r"""["'`(]/(v1|metrics|web)\b""", answer.text), name
    assert httpx.get(f"{url}/web/missing.js").json()["error"]["code"] == "not_found"


def test_disable_web_page_leaves_the_json_404(engine: AsyncEngine) -> None:
    with serving(engine, ServerSettings([MODEL], web_page=False)) as url:
        answer = httpx.get(f"{url}/")
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"
        assert httpx.get(f"{url}/web/app.js").status_code == 404


def test_with_an_api_key_the_page_loads_without_it_and_the_api_still_needs_it(engine: AsyncEngine) -> None:
    with serving(engine, ServerSettings([MODEL], api_key="secret")) as url:
        assert httpx.get(f"{url}/").status_code == 200
        assert httpx.get(f"{url}/web/app.js").status_code == 200
        assert httpx.get(f"{url}/web/missing.js").status_code == 401
        assert httpx.get(f"{url}/v1/models").status_code == 401


def test_the_serve_command_takes_the_page_flags() -> None:
    args = build_parser().parse_args(["serve", "--disable-web-page", "--root-path", "/llm"])
    assert args.disable_web_page and args.root_path == "/llm"
    assert not build_parser().parse_args(["serve"]).disable_web_page


# ---- in the browser --------------------------------------------------------------------------------------


@pytest.mark.browser
def test_a_reply_streams_in_with_its_counts(browser: Browser, url: str) -> None:
    open_chat(browser, url, **{"max-tokens": "24"})
    assert browser.text("#model") == f"{MODEL} · context {context_length(url)} tokens"
    # Every state the reply goes through, with the length of its text then.
    browser.evaluate(
        """window.seen = [];
        new MutationObserver(() => {
            const reply = [...document.querySelectorAll('.message.assistant')].at(-1);
            if (reply) window.seen.push([reply.dataset.state, reply.querySelector('.body').textContent.length]);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true,
                                                          attributes: true})"""
    )
    send(browser, "Say hello in one short sentence.")
    browser.wait_for(f"{LAST_REPLY}.dataset.state === 'done'")
    seen = browser.evaluate("window.seen")
    final = seen[-1][1]
    assert final > 0
    assert any(state == "streaming" and 0 < length < final for state, length in seen), seen
    stats = reply_part(browser, ".stats")
    assert re.search(r"^\d+ tokens · [\d.]+ tokens/s · prompt \d+ tokens", stats), stats
    assert browser.text(".message.user") == "Say hello in one short sentence."
    assert not browser.page_errors()


def context_length(url: str) -> int:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]


@pytest.mark.browser
def test_stop_generating_aborts_the_request_on_the_server(browser: Browser, url: str) -> None:
    aborted = metric(url, "request_success_total", finished_reason="abort")
    open_chat(browser, url, **LONG_REPLY)
    send(browser, "Tell me a long story.")
    wait_streaming(browser)
    assert metric(url, "num_requests_running") == 1
    browser.click("#stop-generating")
    browser.wait_for(f"{LAST_REPLY}.dataset.state === 'stopped'")
    wait_until_idle(url)
    assert metric(url, "request_success_total", finished_reason="abort") == aborted + 1
    assert metric(url, "kv_cache_usage_perc") == 0  # its blocks are free (or idle in the prefix cache)
    assert reply_part(browser, ".stats").startswith("stopped")
    assert browser.evaluate("!document.getElementById('send').hidden")


@pytest.mark.browser
def test_the_status_view_shows_a_request_in_flight(browser: Browser, url: str) -> None:
    open_chat(browser, url, **LONG_REPLY)
    send(browser, "Tell me a long story.")
    wait_streaming(browser)
    browser.click("#tab-status")
    assert browser.evaluate("location.hash") == "#status"
    browser.wait_for("document.getElementById('running').textContent === '1'")
    browser.wait_for("document.getElementById('generation-rate').textContent !== '–'")
    assert browser.text("#kv-cache").endswith("%") and browser.text("#kv-cache") != "0.0 %"
    browser.wait_for("document.querySelector('#card-running path').getAttribute('d').startsWith('M')")
    browser.click("#tab-chat")
    browser.click("#stop-generating")
    wait_until_idle(url)
    browser.click("#tab-status")
    browser.wait_for("document.getElementById('running').textContent === '0'", timeout=5)
    assert not browser.page_errors()


@pytest.mark.browser
def test_the_status_view_shows_speculation_only_when_it_is_on(
    browser: Browser, url: str, smol_loaded: LoadedModel
) -> None:
    browser.goto(url)
    browser.click("#tab-status")
    browser.wait_for("document.getElementById('running').textContent !== '–'")
    assert browser.evaluate("document.getElementById('card-spec-acceptance').hidden")
    speculating = EngineConfig(num_kv_blocks=256, max_num_seqs=4, speculative_method="ngram", ngram_min=1)
    with running_engine(speculating, smol_loaded) as engine, serving(engine, ServerSettings([MODEL])) as spec_url:
        browser.goto(spec_url)
        browser.click("#tab-status")
        browser.wait_for("document.getElementById('running').textContent !== '–'")
        sentence = "The old lighthouse keeper painted seven blue boats before the autumn storms reached the harbour."
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Repeat this sentence exactly, nothing else: {sentence}"}],
            "max_tokens": 30,
            "temperature": 0,
        }
        assert httpx.post(f"{spec_url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        browser.wait_for("!document.getElementById('card-spec-acceptance').hidden")
        browser.wait_for("document.getElementById('spec-acceptance').textContent.endsWith('%')")
        assert float(browser.text("#spec-accepted-per-draft")) > 0
    assert not browser.page_errors()


# Markup in model output: shown as text, never run (and the page's CSP would refuse an inline script anyway).
INJECTION = '<script>window.injected = 1</script><img src=x onerror="window.injected = 2"> and **bold**'


@pytest.mark.browser
def test_markup_in_a_reply_renders_as_text(browser: Browser, url: str) -> None:
    # The constraint makes the model write exactly the payload, through the server as any reply.
    open_chat(browser, url, **{"max-tokens": "100", "extra": json.dumps({"guided_choice": [INJECTION]})})
    send(browser, "Write some HTML.")
    browser.wait_for(f"{LAST_REPLY}.dataset.state === 'done'")
    body = f"{LAST_REPLY}.querySelector('.body')"
    assert browser.evaluate(f"{body}.textContent") == INJECTION.replace("**bold**", "bold")
    assert browser.evaluate(f"{body}.querySelector('strong').textContent") == "bold"
    assert browser.evaluate(f"{body}.querySelectorAll('script, img').length") == 0
    assert browser.evaluate("window.injected === undefined")


REASONING_STREAM = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "First <b>think</b>, "}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "then answer."}}]},
    {"choices": [{"index": 0, "delta": {"content": "The *answer*."}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}},
]


@pytest.mark.browser
def test_reasoning_comes_folded_above_the_reply(browser: Browser, url: str) -> None:
    """A thinking model's stream (the embedded model does not think): the page's fetch answers it here."""
    open_chat(browser, url)
    events = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in REASONING_STREAM) + "data: [DONE]\n\n"
    browser.evaluate(
        f"""(() => {{
            const fetched = window.fetch;
            const headers = {{"Content-Type": "text/event-stream"}};
            window.fetch = (url, init) => String(url).endsWith("chat/completions")
                ? Promise.resolve(new Response({json.dumps(events)}, {{headers}}))
                : fetched(url, init);
        }})()"""
    )
    send(browser, "Think first.")
    browser.wait_for(f"{LAST_REPLY}.dataset.state === 'done'")
    thoughts = f"{LAST_REPLY}.querySelector('details.reasoning')"
    assert browser.evaluate(f"!{thoughts}.hidden && !{thoughts}.open")
    assert reply_part(browser, ".reasoning-text") == "First <b>think</b>, then answer."
    assert browser.evaluate(f"{LAST_REPLY}.querySelector('.body').innerHTML") == "<p>The <em>answer</em>.</p>"
    assert reply_part(browser, ".stats").startswith("9 tokens")


MARKDOWN_CASES = {
    "# Title": "<h1>Title</h1>",
    "a **b** *c* `<d>` ~~e~~": "<p>a <strong>b</strong> <em>c</em> <code>&lt;d&gt;</code> <del>e</del></p>",
    "```html\n<script>x()</script>\n```": (
        '<pre><code class="language-html">&lt;script&gt;x()&lt;/script&gt;</code></pre>'
    ),
    "- one\n- two\n\n3. three": '<ul><li>one</li><li>two</li></ul>\n<ol start="3"><li>three</li></ol>',
    "line one\nline two": "<p>line one<br>line two</p>",
    "> quoted": "<blockquote><p>quoted</p></blockquote>",
    "[site](https://example.com/?a=1&b=2)": (
        '<p><a href="https://example.com/?a=1&amp;b=2" target="_blank" rel="noopener noreferrer">site</a></p>'
    ),
    "[x](javascript:alert(1))": "<p>[x](javascript:alert(1))</p>",
    "<img src=x onerror=alert(1)>": "<p>&lt;img src=x onerror=alert(1)&gt;</p>",
}
HOSTILE = [
    '[a](https://x.com/" onmouseover="alert(1))',
    '[**`<b>`**](https://x.com/`"><script>`)',
    "```\n</code></pre><script>alert(1)</script>",
    "# <svg onload=alert(1)>\n- <iframe src=javascript:alert(1)>\n1. *<a href='javascript:x'>*",
    "_<style>*{}</style>_ ** __\"'&__ \u0000<b>\u0000",
]
SAFE_ATTRIBUTES = r"(href=https?://\S* target=_blank rel=noopener noreferrer|class=language-\S+|start=\d+|)"
ALLOWED_TAGS = {"P", "H1", "H2", "H3", "H4", "H5", "H6", "STRONG", "EM", "DEL", "CODE", "PRE", "UL", "OL", "LI", "A"}
ALLOWED_TAGS |= {"BR", "HR", "BLOCKQUOTE"}


@pytest.mark.browser
def test_the_markdown_renderer_escapes_before_it_marks_up(browser: Browser, url: str) -> None:
    browser.goto(url)
    render = "(await import(new URL('web/markdown.js', document.baseURI))).renderMarkdown"
    rendered = browser.evaluate(f"(async () => {json.dumps(list(MARKDOWN_CASES))}.map({render}))()")
    assert dict(zip(MARKDOWN_CASES, rendered)) == MARKDOWN_CASES
    # Whatever the input, the output holds only the renderer's own tags, and links only to http(s).
    found = browser.evaluate(
        f"""(async () => {{
            const render = {render};
            return {json.dumps(HOSTILE)}.map((text) => {{
                const holder = document.createElement('template');
                holder.innerHTML = render(text);
                return [...holder.content.querySelectorAll('*')].map((node) => [node.tagName,
                    [...node.attributes].map((a) => `${{a.name}}=${{a.value}}`).join(' ')]);
            }});
        }})()"""
    )
    for text, nodes in zip(HOSTILE, found):
        for tag, attributes in nodes:
            assert tag in ALLOWED_TAGS, (text, tag)
            assert re.fullmatch(SAFE_ATTRIBUTES, attributes), (text, attributes)


# ---- behind a proxy ---------------------------------------------------------------------------------------


def prefix_proxy(upstream: str, prefix: str) -> ASGIApp:
    """A reverse proxy serving `upstream` under `prefix`, which it strips (nginx's `proxy_pass http://up/;`)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if not (path == prefix or path.startswith(prefix + "/")):
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        headers = [(name, value) for name, value in scope["headers"] if name != b"host"]
        async with httpx.AsyncClient(base_url=upstream, timeout=60) as client:
            request = client.build_request(
                scope["method"], path[len(prefix) :] or "/", params=scope["query_string"], headers=headers, content=body
            )
            response = await client.send(request, stream=True)
            skip = {b"content-length", b"transfer-encoding", b"connection"}
            kept = [(name, value) for name, value in response.headers.raw if name.lower() not in skip]
            await send({"type": "http.response.start", "status": response.status_code, "headers": kept})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            await response.aclose()

    return app


@pytest.mark.browser
def test_behind_a_proxy_prefix_the_page_asks_for_the_key_and_chats(browser: Browser, engine: AsyncEngine) -> None:
    app = create_app(engine, ServerSettings([MODEL], api_key="secret"))
    with BackgroundServer(app, root_path="/llm") as server, BackgroundServer(prefix_proxy(server.url, "/llm")) as proxy:
        # Probes and metrics stay open under the prefix; the API does not.
        assert [httpx.get(f"{proxy.url}/llm{path}").status_code for path in ("/ready", "/metrics")] == [200, 200]
        assert httpx.get(f"{proxy.url}/llm/v1/models").status_code == 401
        browser.goto(f"{proxy.url}/llm")  # no trailing slash: the page's <base> names the prefix
        browser.evaluate("localStorage.clear()")
        browser.goto(f"{proxy.url}/llm")
        browser.wait_for("!document.getElementById('key-form').hidden")
        assert "API key" in browser.text("#key-error")
        browser.fill("#api-key", "secret")
        browser.evaluate("document.getElementById('key-form').requestSubmit()")
        browser.wait_for("document.getElementById('model').textContent.includes('context')")
        assert browser.evaluate("document.getElementById('key-form').hidden")
        browser.fill("#max-tokens", "8")
        send(browser, "Hi")
        browser.wait_for(f"{LAST_REPLY}.dataset.state === 'done'")
        assert reply_part(browser, ".body").strip()
        browser.click("#tab-status")
        browser.wait_for("document.getElementById('running').textContent === '0'")
        assert not browser.page_errors()
