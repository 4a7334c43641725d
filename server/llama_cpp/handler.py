"""llama.cpp's POST /completion, POST /apply-template and GET /props, on the same engine as the OpenAI endpoints.

/completion answers llama.cpp's way: `content`, `tokens` (with return_tokens), `stop_type` ("eos", "limit",
"word"), `stopping_word`, `timings`, `generation_settings`; a list of prompts gets a list of answers. Streamed, each
event is `{"content", "tokens", "stop": false}` and the last `{"stop": true, ...}` with the final fields, with no
`[DONE]` (llama.cpp sends none here).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from pagedserve.engine import CompletionOutput
from pagedserve.server.context import VERSION, serving
from pagedserve.server.errors import to_api_error
from pagedserve.server.generation import Generation, Streams, recorded
from pagedserve.server.llama_cpp.protocol import ApplyTemplateRequest, ApplyTemplateResponse, LlamaCompletionRequest
from pagedserve.server.llama_cpp.reply import LlamaReply
from pagedserve.server.sse import Event, failure_recorded, sse_response

router = APIRouter(tags=["llama.cpp"])


@router.post("/completion")
async def completion(body: LlamaCompletionRequest, request: Request) -> Any:
    ctx = serving(request)
    call = Generation(request, body.model or ctx.model_name)
    engine = call.engine
    with call.client_errors("prompt"):
        params = body.sampling_params()
        prompts = [await engine.encode_prompt(prompt) for prompt in body.prompts]
    streams = await call.start(prompts, params, "prompt", body.timeout)
    reply = LlamaReply(ctx, body, params, prompts)
    if body.stream:
        return sse_response(_events(reply, streams, call), streams)
    outputs = await call.collect(streams, 1)
    cached = call.record.cached_by_prompt
    answers = [reply.final(output, index, cached=cached.get(index, 0)) for index, output in enumerate(outputs)]
    return answers if body.many else answers[0]


async def _events(reply: LlamaReply, streams: Streams, call: Generation) -> AsyncIterator[Event]:
    with failure_recorded(call.record) as failure:
        outputs = [CompletionOutput(index=0) for _ in streams]
        async with contextlib.aclosing(recorded(streams, call.record)) as deltas:
            async for prompt_index, delta in deltas:
                outputs[prompt_index].extend(delta)
                if delta.new_text or delta.new_token_ids:
                    yield {"data": json.dumps(reply.partial(delta, prompt_index))}
                if delta.finished:
                    cached = call.record.cached_by_prompt.get(prompt_index, 0)
                    final = reply.final(outputs[prompt_index], prompt_index, streamed=True, cached=cached)
                    yield {"data": json.dumps(final)}
    if failure.error is not None:
        yield {"data": json.dumps(failure.error.body())}


@router.post("/apply-template", response_model=ApplyTemplateResponse)
async def apply_template(body: ApplyTemplateRequest, request: Request) -> ApplyTemplateResponse:
    engine = serving(request).ready_engine()
    messages = [message.for_template() for message in body.messages]
    try:
        prompt = engine.tokenizer.render_chat(
            messages,
            body.add_generation_prompt,
            body.continue_final_message,
            body.template_tools(),
            body.chat_template_kwargs,
        )
    except ValueError as exc:
        raise to_api_error(exc, "messages") from exc
    return ApplyTemplateResponse(prompt=prompt)


@router.get("/props")
async def props(request: Request) -> dict[str, Any]:
    """What llama.cpp's /props says that holds here: /completion's defaults, the context, the seats, the template."""
    ctx = serving(request)
    engine = ctx.ready_engine()
    defaults = LlamaCompletionRequest(prompt="x")
    return {
        "default_generation_settings": {"n_ctx": engine.limits.max_model_len, "params": defaults.generation_settings()},
        "total_slots": engine.limits.max_num_seqs,
        "model_alias": ctx.model_name,
        "model_path": ctx.model_name,
        "chat_template": engine.tokenizer.chat_template or "",
        "modalities": {"vision": False, "audio": False},
        "build_info": f"pagedserve-{VERSION}",
    }
