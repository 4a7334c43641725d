// One streamed reply: the /v1/chat/completions events read as they arrive, and the assistant message they
// build (its text as Markdown, its reasoning folded, its token counts and speed).

import { element, isScrolledToEnd, scrollToEnd } from "./dom.js";
import { renderMarkdown } from "./markdown.js";

// Server-sent events: `data:` lines, an event per blank line; `[DONE]` ends the stream, and a stream that
// fails after it started ends with an {"error": ...} event.
export async function readEvents(response, onChunks) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new Error("the connection closed before the reply ended");
    buffer += value;
    const lines = buffer.split(/\r?\n/);
    buffer = lines.pop();
    const chunks = [];
    for (const line of lines) {
      if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      if (line || !data.length) continue;
      const payload = data.join("\n");
      data = [];
      if (payload === "[DONE]") {
        onChunks(chunks);
        return;
      }
      const chunk = JSON.parse(payload);
      if (chunk.error) throw new Error(chunk.error.message);
      chunks.push(chunk);
    }
    onChunks(chunks);
  }
}

// One assistant message as it streams in: its text (Markdown), its reasoning (folded), its counts.
export class Reply {
  constructor(container) {
    this.content = "";
    this.reasoning = "";
    this.usage = null;
    this.finishReason = null;
    this.sentAt = performance.now();
    this.firstTokenAt = null;
    this.article = element("article", "message assistant");
    this.article.dataset.state = "streaming";
    this.thoughts = element("details", "reasoning");
    this.thoughts.hidden = true;
    this.thoughts.append(element("summary", "", "Reasoning"), (this.thoughtText = element("div", "reasoning-text")));
    this.body = element("div", "body");
    this.stats = element("footer", "stats", "…");
    this.article.append(this.thoughts, this.body, this.stats);
    container.append(this.article);
    scrollToEnd();
  }

  apply(chunk) {
    if (chunk.usage) this.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      if (delta.reasoning_content) this.reasoning += delta.reasoning_content;
      if (delta.content) this.content += delta.content;
      if ((delta.content || delta.reasoning_content) && this.firstTokenAt === null) {
        this.firstTokenAt = performance.now();
      }
      if (choice.finish_reason) this.finishReason = choice.finish_reason;
    }
  }

  render() {
    const following = isScrolledToEnd();
    this.body.innerHTML = renderMarkdown(this.content); // escaped first: model output never becomes HTML
    this.thoughtText.textContent = this.reasoning;
    this.thoughts.hidden = !this.reasoning;
    if (following) scrollToEnd();
  }

  finish() {
    this.render();
    this.article.dataset.state = "done";
    this.stats.textContent = this.statistics(performance.now()).join(" · ");
  }

  stopped() {
    this.render();
    this.article.dataset.state = "stopped";
    this.stats.textContent = ["stopped", ...this.statistics(performance.now())].join(" · ");
  }

  fail(message) {
    this.render();
    this.article.dataset.state = "error";
    this.stats.textContent = "";
    this.article.append(element("p", "error", message));
  }

  statistics(endedAt) {
    const parts = [];
    if (this.usage) {
      const { prompt_tokens: prompt, completion_tokens: completion } = this.usage;
      const cached = this.usage.prompt_tokens_details?.cached_tokens;
      parts.push(`${completion} tokens`);
      // The first token comes with the prompt's prefill: the rate is the decode speed after it.
      const seconds = (endedAt - (this.firstTokenAt ?? this.sentAt)) / 1000;
      if (completion > 1 && seconds > 0) parts.push(`${((completion - 1) / seconds).toFixed(1)} tokens/s`);
      parts.push(`prompt ${prompt} tokens${cached ? ` (${cached} cached)` : ""}`);
    }
    if (this.firstTokenAt !== null) {
      parts.push(`first token ${((this.firstTokenAt - this.sentAt) / 1000).toFixed(2)} s`);
    }
    if (this.finishReason === "length") parts.push("cut at max tokens");
    return parts;
  }
}
