// The HTTP side of the page: API key handling, JSON calls and the SSE client for chat streams.
// Every URL is relative to the page, so the playground also works behind a path-prefix proxy.

const KEY_STORAGE = "mlx-engined.api-key";
let keyPrompt = null;       // a function returning a Promise<string|null>, set by the app
let pendingPrompt = null;   // one dialog for every request that got a 401 at the same time

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function setKeyPrompt(fn) { keyPrompt = fn; }
export function apiKey() { return sessionStorage.getItem(KEY_STORAGE) || ""; }
export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

function headers(extra = {}) {
  const out = { ...extra };
  const key = apiKey();
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

async function askForKey(message) {
  if (!keyPrompt) return null;
  if (!pendingPrompt) {
    pendingPrompt = keyPrompt(message).finally(() => { pendingPrompt = null; });
  }
  return pendingPrompt;
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    const error = body.error || body;
    if (error && typeof error.message === "string") message = error.message;
    if (error && error.code) code = error.code;
  } catch { /* not JSON: keep the status line */ }
  return new ApiError(response.status, message, code);
}

// fetch with the key; on a 401 asks the user for a key (once) and retries.
// `quiet` requests (the stats poll) never open the dialog themselves.
export async function apiFetch(path, { quiet = false, ...init } = {}) {
  for (let attempt = 0; ; attempt++) {
    const response = await fetch(path, { ...init, headers: headers(init.headers) });
    if (response.status !== 401 || quiet || attempt > 2) return response;
    const wrong = apiKey() ? "That key was refused. " : "";
    const key = await askForKey(`${wrong}This server needs an API key.`);
    if (key === null) return response;
    setApiKey(key);
  }
}

export async function getJSON(path, options = {}) {
  const response = await apiFetch(path, options);
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// POST a streamed chat completion and call onChunk with every parsed `data:` payload.
// Resolves at `[DONE]` or the end of the body; rejects with ApiError on an HTTP or in-stream
// error, and with an AbortError when `signal` aborts (closing the connection: the engine
// then aborts the request).
export async function streamChat(body, { signal, onChunk }) {
  const response = await apiFetch("v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
    body: JSON.stringify({ ...body, stream: true }),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        if (parseEvent(block, onChunk) === "done") return;
      }
    }
    if (buffer.trim()) parseEvent(buffer, onChunk);
  } finally {
    reader.releaseLock();
  }
}

// One SSE event block: `data:` lines joined; comments (keep-alives) ignored.
export function parseEvent(block, onChunk) {
  const data = block.split(/\r?\n/)
    .filter((line) => line.startsWith("data:"))
    .map((line) => line.slice(5).replace(/^ /, ""))
    .join("\n");
  if (!data) return null;
  if (data === "[DONE]") return "done";
  const payload = JSON.parse(data);
  if (payload.error) {
    throw new ApiError(payload.error.status || 500, payload.error.message || "stream error", payload.error.code);
  }
  onChunk(payload);
  return null;
}
