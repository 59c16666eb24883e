// One streamed answer: folds chat.completion.chunk payloads into content, reasoning, tool calls
// and usage, times it (TTFT, tokens/s) and renders it. Shared by the chat and the compare view.

import { streamChat } from "./api.js";
import { renderMarkdown } from "./markdown.js";

export class Turn {
  constructor() {
    this.content = "";
    this.reasoning = "";
    this.toolCalls = [];
    this.usage = null;
    this.finish = null;
    this.error = null;
    this.stopped = false;
    this.streaming = false;
    this.model = null;
    this.chunks = 0;
    this.t0 = performance.now();
    this.tFirst = null;
    this.tEnd = null;
  }

  apply(chunk) {
    if (chunk.model) this.model = chunk.model;
    if (chunk.usage) this.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      const reasoning = delta.reasoning_content ?? delta.reasoning;
      let produced = false;
      if (reasoning) { this.reasoning += reasoning; produced = true; }
      if (delta.content) { this.content += delta.content; produced = true; }
      for (const call of delta.tool_calls || []) {
        const index = call.index ?? this.toolCalls.length;
        const slot = this.toolCalls[index] ||= { id: "", type: "function", function: { name: "", arguments: "" } };
        if (call.id) slot.id = call.id;
        if (call.function?.name) slot.function.name += call.function.name;
        if (call.function?.arguments) slot.function.arguments += call.function.arguments;
        produced = true;
      }
      if (produced) {
        this.chunks++;
        if (this.tFirst === null) this.tFirst = performance.now();
      }
      if (choice.finish_reason) this.finish = choice.finish_reason;
    }
  }

  get ttft() { return this.tFirst === null ? null : (this.tFirst - this.t0) / 1000; }

  // Output tokens over the time they streamed in. When they came almost at once (a tool call
  // parsed whole, a short answer), over the whole request instead, rather than an absurd rate.
  get tokensPerSecond() {
    const tokens = this.usage?.completion_tokens;
    if (!tokens || this.tFirst === null || this.tEnd === null) return null;
    const streaming = this.tEnd - this.tFirst;
    const total = this.tEnd - this.t0;
    const window = streaming >= 0.25 * total && streaming > 0 ? streaming : total;
    return window > 0 ? tokens / (window / 1000) : null;
  }

  // The assistant message to send back in the next request's history.
  asMessage() {
    const message = { role: "assistant" };
    if (this.content || !this.toolCalls.length) message.content = this.content;
    if (this.toolCalls.length) message.tool_calls = this.toolCalls.filter(Boolean);
    return message;
  }
}

// Streams `body` into `turn`, calling `onUpdate` at most once per animation frame.
export async function runTurn(body, turn, { signal, onUpdate }) {
  let scheduled = false;
  const update = () => {
    if (scheduled) return;
    scheduled = true;
    requestAnimationFrame(() => { scheduled = false; onUpdate(turn); });
  };
  turn.streaming = true;
  update();
  try {
    await streamChat({ ...body, stream_options: { include_usage: true } }, {
      signal,
      onChunk: (chunk) => { turn.apply(chunk); update(); },
    });
  } catch (err) {
    if (err.name === "AbortError") turn.stopped = true;
    else turn.error = err;
  } finally {
    turn.streaming = false;
    turn.tEnd = performance.now();
    onUpdate(turn);
  }
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function prettyArguments(text) {
  try { return JSON.stringify(JSON.parse(text), null, 2); } catch { return text; }
}

export function toolCard(call, { onResult } = {}) {
  const card = el("section", "tool-card");
  card.setAttribute("aria-label", `Tool call ${call.function.name}`);
  const head = el("header");
  head.append(el("span", "tool-icon", "ƒ"), el("strong", "tool-name", call.function.name || "…"));
  if (call.id) head.append(el("span", "muted small tool-id", call.id));
  card.append(head, el("pre", "tool-args", prettyArguments(call.function.arguments)));
  if (onResult) {
    const form = el("form", "tool-result");
    const id = `result-${call.id || Math.random().toString(36).slice(2)}`;
    const label = el("label", "sr-only", `Result of ${call.function.name}`);
    label.htmlFor = id;
    const input = el("input");
    input.id = id;
    input.placeholder = "Result to send back…";
    const button = el("button", "small", "Send result");
    button.type = "submit";
    form.append(label, input, button);
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      onResult(call, input.value);
    });
    card.append(form);
  }
  return card;
}

function metaLine(turn) {
  const parts = [];
  const u = turn.usage;
  if (u) {
    parts.push(`prompt ${u.prompt_tokens}`);
    const cached = u.prompt_tokens_details?.cached_tokens;
    if (cached) parts.push(`cached ${cached}`);
    parts.push(`completion ${u.completion_tokens}`);
  }
  if (turn.ttft !== null) parts.push(`TTFT ${(turn.ttft * 1000).toFixed(0)} ms`);
  const tps = turn.tokensPerSecond;
  if (tps !== null) parts.push(`${tps.toFixed(1)} tok/s`);
  if (turn.finish && turn.finish !== "stop") parts.push(`finish: ${turn.finish}`);
  if (turn.stopped) parts.push("stopped");
  return parts.join(" · ");
}

// Renders `turn` into `container`, keeping the reasoning box's open/closed state across updates.
export function renderTurn(turn, container, { onToolResult } = {}) {
  if (!container.querySelector(":scope > .content")) {
    const error = el("p", "error");
    error.setAttribute("role", "alert");
    error.hidden = true;
    container.append(el("div", "content md"), el("div", "tools"), error, el("p", "meta"));
  }
  const [body, tools, error, meta] = ["content", "tools", "error", "meta"]
    .map((name) => container.querySelector(`:scope > .${name}`));
  let reasoning = container.querySelector(":scope > details.reasoning");
  if (turn.reasoning) {
    if (!reasoning) {
      reasoning = el("details", "reasoning");
      reasoning.append(el("summary"), el("div", "reasoning-body md"));
      container.prepend(reasoning);
    }
    reasoning.firstChild.textContent = turn.streaming && !turn.content && !turn.toolCalls.length
      ? "Thinking…" : `Reasoning (${turn.reasoning.length.toLocaleString()} characters)`;
    reasoning.lastChild.replaceChildren(renderMarkdown(turn.reasoning));
  } else if (reasoning) {
    reasoning.remove();
  }
  body.replaceChildren(renderMarkdown(turn.content));
  body.classList.toggle("typing", turn.streaming);
  if (turn.streaming && !turn.content && !turn.reasoning && !turn.toolCalls.length) {
    body.append(el("span", "dots", "…"));
  }
  tools.replaceChildren(...turn.toolCalls.filter(Boolean).map((call) => toolCard(call, {
    onResult: !turn.streaming && onToolResult ? onToolResult : null })));
  error.hidden = !turn.error;
  error.textContent = turn.error ? (turn.error.message || String(turn.error)) : "";
  meta.textContent = metaLine(turn);
}
