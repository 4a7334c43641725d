// Calls to the server's API, with the API key when the server wants one. URLs are relative to the page, so
// that a proxy serving the server under a prefix serves every call there too.

const KEY_STORAGE = "pagedserve.apiKey";

export class AuthError extends Error {}

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

export async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  const key = apiKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) throw new AuthError(await errorMessage(response));
  return response;
}

export async function errorMessage(response) {
  const text = await response.text();
  try {
    return JSON.parse(text).error.message;
  } catch {
    return `${response.status} ${response.statusText}: ${text.slice(0, 200)}`;
  }
}

// The served model: its name and context length (GET /v1/models).
export async function servedModel() {
  const response = await api("v1/models");
  if (!response.ok) throw new Error(await errorMessage(response));
  const [model] = (await response.json()).data;
  return { name: model.id, contextLength: model.max_model_len };
}
