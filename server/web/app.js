// The page's start: find the served model (asking for the API key when the server wants one), then wire the
// chat and the status view to the page.

import { AuthError, servedModel, setApiKey } from "./api.js";
import { Chat } from "./chat.js";
import { byId } from "./dom.js";
import { StatusView } from "./status.js";

const RETRY_MS = 2000;

const chat = new Chat(askForKey);
const status = new StatusView(byId("cards"));

function showView(name) {
  for (const view of ["chat", "status"]) {
    byId(`${view}-view`).hidden = view !== name;
    byId(`tab-${view}`).setAttribute("aria-selected", String(view === name));
  }
}

function askForKey(message) {
  byId("key-form").hidden = false;
  byId("key-error").textContent = message || "";
  byId("api-key").focus();
}

// /v1/models answers 503 while the model loads: try again until it is ready.
async function connect() {
  for (;;) {
    try {
      const model = await servedModel();
      byId("key-form").hidden = true;
      byId("model").textContent = `${model.name} · context ${model.contextLength} tokens`;
      chat.setModel(model);
      return;
    } catch (error) {
      if (error instanceof AuthError) {
        byId("model").textContent = "API key needed";
        askForKey(error.message);
        return;
      }
      byId("model").textContent = `not ready: ${error.message}`;
      await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
    }
  }
}

function sendPrompt() {
  const prompt = byId("prompt");
  if (chat.generating || !prompt.value.trim()) return;
  chat.send(prompt.value);
  prompt.value = "";
}

// The view is in the URL's fragment, so that /#status opens the status view.
const viewInUrl = () => (location.hash === "#status" ? "status" : "chat");
byId("tab-chat").addEventListener("click", () => (location.hash = "chat"));
byId("tab-status").addEventListener("click", () => (location.hash = "status"));
window.addEventListener("hashchange", () => showView(viewInUrl()));
byId("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  sendPrompt();
});
byId("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    sendPrompt();
  }
});
byId("stop-generating").addEventListener("click", () => chat.stop());
byId("clear").addEventListener("click", () => chat.clear());
byId("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  setApiKey(byId("api-key").value.trim());
  byId("api-key").value = "";
  connect();
});

showView(viewInUrl());
status.start();
connect();
