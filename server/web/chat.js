// The conversation: each message goes out as a streamed /v1/chat/completions request, the same SSE any
// client reads; "Stop generating" aborts the fetch, and the server frees the request's blocks when the
// connection closes.

import { api, AuthError, errorMessage } from "./api.js";
import { byId, element, scrollToEnd } from "./dom.js";
import { readEvents, Reply } from "./reply.js";

const SETTINGS_STORAGE = "pagedserve.chatSettings";
const SETTINGS = ["system", "temperature", "max-tokens", "stop", "extra"];

export class Chat {
  constructor(onAuthError) {
    this.onAuthError = onAuthError;
    this.history = []; // what the model sees: {role, content}
    this.conversation = 0; // counts "New conversation"s: a reply that ends after one stays out of the new one
    this.controller = null;
    this.model = null;
    restoreSettings();
  }

  setModel(model) {
    this.model = model;
    byId("send").disabled = false;
  }

  get generating() {
    return this.controller !== null;
  }

  stop() {
    this.controller?.abort();
  }

  clear() {
    this.stop();
    this.conversation += 1;
    this.history = [];
    byId("messages").replaceChildren();
  }

  async send(text) {
    if (this.generating || !this.model || !text.trim()) return;
    let body;
    try {
      body = this.requestBody([...this.history, { role: "user", content: text }]);
    } catch (error) {
      showNotice(error.message);
      return;
    }
    showNotice("");
    const conversation = this.conversation;
    this.history.push({ role: "user", content: text });
    addUserMessage(text);
    const reply = new Reply(byId("messages"));
    this.controller = new AbortController();
    setGenerating(true);
    try {
      await this.stream(body, reply, this.controller.signal);
      reply.finish();
    } catch (error) {
      this.failed(reply, error);
    } finally {
      this.remember(conversation, reply);
      this.controller = null;
      setGenerating(false);
    }
  }

  // The reply joins the history it answers, unless "New conversation" came first.
  remember(conversation, reply) {
    if (conversation !== this.conversation) return;
    if (reply.content) this.history.push({ role: "assistant", content: reply.content });
    else this.history.pop(); // nothing came back: the next message must not follow an unanswered one
  }

  async stream(body, reply, signal) {
    const init = { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
    const response = await api("v1/chat/completions", { ...init, signal });
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (chunks) => {
      chunks.forEach((chunk) => reply.apply(chunk));
      reply.render();
    });
  }

  failed(reply, error) {
    if (error.name === "AbortError") {
      reply.stopped();
      return;
    }
    reply.fail(error.message);
    if (error instanceof AuthError) this.onAuthError(error.message);
  }

  requestBody(messages) {
    const system = byId("system").value.trim();
    const body = {
      model: this.model.name,
      messages: system ? [{ role: "system", content: system }, ...messages] : messages,
      stream: true,
      stream_options: { include_usage: true },
    };
    const temperature = parseFloat(byId("temperature").value);
    if (Number.isFinite(temperature)) body.temperature = temperature;
    const maxTokens = parseInt(byId("max-tokens").value, 10);
    if (maxTokens > 0) body.max_tokens = maxTokens;
    const stop = byId("stop").value.split("\n").filter((line) => line);
    if (stop.length) body.stop = stop;
    return { ...body, ...extraFields() };
  }
}

function extraFields() {
  const text = byId("extra").value.trim();
  if (!text) return {};
  let fields;
  try {
    fields = JSON.parse(text);
  } catch (error) {
    throw new Error(`More request fields: not JSON (${error.message})`);
  }
  if (typeof fields !== "object" || fields === null || Array.isArray(fields)) {
    throw new Error("More request fields: write a JSON object, e.g. {\"top_k\": 40}");
  }
  return fields;
}

function addUserMessage(text) {
  const article = element("article", "message user");
  article.append(element("div", "body", text));
  byId("messages").append(article);
  scrollToEnd();
}

function setGenerating(generating) {
  byId("send").hidden = generating;
  byId("stop-generating").hidden = !generating;
}

function showNotice(text) {
  byId("notice").textContent = text;
}

function restoreSettings() {
  const saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}");
  for (const id of SETTINGS) {
    if (typeof saved[id] === "string") byId(id).value = saved[id];
    byId(id).addEventListener("change", saveSettings);
  }
}

function saveSettings() {
  const values = Object.fromEntries(SETTINGS.map((id) => [id, byId(id).value]));
  localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(values));
}

