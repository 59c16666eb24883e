// The chat view: the conversation, the composer, attachments and the per-message actions
// (copy, edit and resend, regenerate, stop). Requests are built from the whole history.

import { renderMarkdown } from "./markdown.js";
import { Turn, renderTurn, runTurn } from "./turn.js";

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(label, onClick, { className = "ghost small", title } = {}) {
  const b = el("button", className, label);
  b.type = "button";
  if (title) b.title = title;
  b.addEventListener("click", onClick);
  return b;
}

// Copy: the async clipboard where the page is a secure context, else a selected textarea.
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    try { await navigator.clipboard.writeText(text); return true; } catch { /* fall back */ }
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.className = "sr-only";
  document.body.append(area);
  area.select();
  let ok = false;
  try { ok = document.execCommand("copy"); } catch { ok = false; }
  area.remove();
  return ok;
}

export function flash(buttonEl, text) {
  const before = buttonEl.textContent;
  buttonEl.textContent = text;
  setTimeout(() => { buttonEl.textContent = before; }, 1200);
}

// Files → attachments: images as data: URIs (image_url parts), wav/mp3 as input_audio parts.
export function readAttachment(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onerror = () => reject(reader.error);
    reader.onload = () => {
      const url = String(reader.result);
      if (file.type.startsWith("image/")) {
        resolve({ kind: "image", name: file.name, url });
      } else if (file.type.startsWith("audio/") || /\.(wav|mp3)$/i.test(file.name)) {
        const format = /mpeg|mp3/i.test(file.type) || /\.mp3$/i.test(file.name) ? "mp3" : "wav";
        resolve({ kind: "audio", name: file.name, url, format, data: url.slice(url.indexOf(",") + 1) });
      } else {
        reject(new Error(`${file.name}: not an image or a wav/mp3 audio file`));
      }
    };
    reader.readAsDataURL(file);
  });
}

export class Chat {
  constructor({ settings, model, root }) {
    this.settings = settings;
    this.model = model;        // () => the chosen model id
    this.messages = [];        // {role, content, attachments?, turn?, tool_call_id?}
    this.attachments = [];
    this.controller = null;
    this.list = root.querySelector("#messages");
    this.empty = root.querySelector("#empty");
    this.prompt = root.querySelector("#prompt");
    this.form = root.querySelector("#composer");
    this.sendButton = root.querySelector("#send");
    this.stopButton = root.querySelector("#stop");
    this.tray = root.querySelector("#attachments");
    this.fileInput = root.querySelector("#file-input");

    this.form.addEventListener("submit", (event) => { event.preventDefault(); this.send(); });
    this.prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    this.stopButton.addEventListener("click", () => this.stop());
    this.fileInput.addEventListener("change", async () => {
      await this.attach([...this.fileInput.files]);
      this.fileInput.value = "";
    });
    root.querySelector("#clear-chat").addEventListener("click", () => {
      this.stop();
      this.messages = [];
      this.render();
      this.prompt.focus();
    });
  }

  get busy() { return this.controller !== null; }

  async attach(files) {
    for (const file of files) {
      try {
        this.attachments.push(await readAttachment(file));
      } catch (err) {
        this.notice(err.message);
      }
    }
    this.renderTray();
  }

  renderTray() {
    this.tray.replaceChildren(...this.attachments.map((a, i) => {
      const chip = el("div", "chip");
      if (a.kind === "image") {
        const img = el("img");
        img.src = a.url;
        img.alt = a.name;
        chip.append(img);
      } else {
        chip.append(el("span", "chip-icon", "♪"));
      }
      chip.append(el("span", "chip-name", a.name));
      chip.append(button("×", () => { this.attachments.splice(i, 1); this.renderTray(); },
        { className: "chip-remove", title: `Remove ${a.name}` }));
      chip.lastChild.setAttribute("aria-label", `Remove ${a.name}`);
      return chip;
    }));
  }

  notice(text) {
    const p = el("p", "notice", text);
    p.setAttribute("role", "alert");
    this.list.append(p);
    setTimeout(() => p.remove(), 6000);
  }

  // The messages of the request: system prompt, then the history with attachments as parts.
  history() {
    const out = [];
    if (this.settings.system) out.push({ role: "system", content: this.settings.system });
    for (const m of this.messages) {
      if (m.role === "assistant") {
        if (m.turn.error && !m.turn.content && !m.turn.toolCalls.length) continue;
        out.push(m.turn.asMessage());
      } else if (m.role === "tool") {
        out.push({ role: "tool", tool_call_id: m.tool_call_id, content: m.content });
      } else if (m.attachments?.length) {
        const parts = [{ type: "text", text: m.content }];
        for (const a of m.attachments) {
          parts.push(a.kind === "image" ? { type: "image_url", image_url: { url: a.url } }
            : { type: "input_audio", input_audio: { data: a.data, format: a.format } });
        }
        out.push({ role: "user", content: parts });
      } else {
        out.push({ role: "user", content: m.content });
      }
    }
    return out;
  }

  send() {
    const text = this.prompt.value.trim();
    if (this.busy || (!text && !this.attachments.length)) return;
    this.messages.push({ role: "user", content: text, attachments: this.attachments });
    this.attachments = [];
    this.renderTray();
    this.prompt.value = "";
    this.generate();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  async generate() {
    let fields;
    try {
      fields = this.settings.requestFields();
    } catch (err) {
      this.render();
      this.notice(err.message);
      return;
    }
    const turn = new Turn();
    turn.streaming = true;  // rendered as streaming (no Regenerate) from the start
    const message = { role: "assistant", turn };
    const body = { model: this.model() || undefined, messages: this.history(), ...fields };
    this.messages.push(message);
    this.controller = new AbortController();
    this.setBusy(true);
    this.render();
    const node = this.list.querySelector(".msg:last-of-type .answer");
    const stick = () => this.nearBottom();
    await runTurn(body, turn, {
      signal: this.controller.signal,
      onUpdate: () => {
        const follow = stick();
        renderTurn(turn, node, { onToolResult: (call, result) => this.toolResult(call, result) });
        if (follow) this.list.scrollTop = this.list.scrollHeight;
      },
    });
    this.controller = null;
    this.setBusy(false);
    this.render();
  }

  toolResult(call, result) {
    if (this.busy) return;
    this.messages.push({ role: "tool", tool_call_id: call.id, name: call.function.name, content: result });
    this.generate();
  }

  nearBottom() {
    return this.list.scrollHeight - this.list.scrollTop - this.list.clientHeight < 80;
  }

  setBusy(busy) {
    this.stopButton.hidden = !busy;
    this.sendButton.disabled = busy;
    this.list.setAttribute("aria-busy", String(busy));
    if (busy) this.stopButton.focus({ preventScroll: true });
    else if (document.activeElement === this.stopButton || document.activeElement === document.body) {
      this.prompt.focus({ preventScroll: true });
    }
  }

  regenerate(index) {
    if (this.busy) return;
    this.messages.splice(index);
    this.generate();
  }

  edit(index, article) {
    if (this.busy) return;
    const m = this.messages[index];
    const box = el("div", "edit-box");
    const label = el("label", "sr-only", "Edit message");
    const area = el("textarea");
    area.id = `edit-${index}`;
    label.htmlFor = area.id;
    area.value = m.content;
    area.rows = Math.min(12, Math.max(2, m.content.split("\n").length + 1));
    const save = button("Save & send", () => {
      m.content = area.value;
      this.messages.splice(index + 1);
      this.generate();
    }, { className: "primary small" });
    const cancel = button("Cancel", () => this.render(), { className: "ghost small" });
    area.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) { event.preventDefault(); save.click(); }
      if (event.key === "Escape") { event.preventDefault(); cancel.click(); }
    });
    const bar = el("div", "composer-bar");
    bar.append(el("span", "spacer"), cancel, save);
    box.append(label, area, bar);
    article.querySelector(".bubble").replaceWith(box);
    area.focus();
  }

  render() {
    this.empty.hidden = this.messages.length > 0;
    const nodes = this.messages.map((m, i) => this.renderMessage(m, i));
    this.list.replaceChildren(this.empty, ...nodes);
    this.list.scrollTop = this.list.scrollHeight;
  }

  renderMessage(m, index) {
    const article = el("article", `msg ${m.role}`);
    const lastAssistant = m.role === "assistant" && index === this.messages.length - 1;
    const who = { user: "You", assistant: m.turn?.model ? m.turn.model.split("/").pop() : "Assistant",
                  tool: `Tool result · ${m.name || ""}` }[m.role];
    article.setAttribute("aria-label", m.role === "user" ? "Your message" : `${m.role} message`);
    article.append(el("div", "who", who));
    const bubble = article.appendChild(el("div", "bubble"));
    const actions = el("div", "actions");
    if (m.role === "assistant") {
      const answer = bubble.appendChild(el("div", "answer"));
      renderTurn(m.turn, answer, lastAssistant ? { onToolResult: (call, r) => this.toolResult(call, r) } : {});
      const copy = button("Copy", async () => flash(copy, (await copyText(m.turn.content)) ? "Copied" : "Copy failed"));
      actions.append(copy);
      if (lastAssistant && !m.turn.streaming) {
        actions.append(button("Regenerate", () => this.regenerate(index)));
      }
    } else if (m.role === "tool") {
      bubble.append(el("pre", "tool-args", m.content));
    } else {
      const content = bubble.appendChild(el("div", "md"));
      content.append(renderMarkdown(m.content));
      if (m.attachments?.length) {
        const strip = bubble.appendChild(el("div", "attachments"));
        for (const a of m.attachments) {
          if (a.kind === "image") {
            const img = el("img", "thumb");
            img.src = a.url;
            img.alt = a.name;
            strip.append(img);
          } else {
            strip.append(el("span", "chip", `♪ ${a.name}`));
          }
        }
      }
      actions.append(button("Edit", () => this.edit(index, article)));
      const copy = button("Copy", async () => flash(copy, (await copyText(m.content)) ? "Copied" : "Copy failed"));
      actions.append(copy);
    }
    article.append(actions);
    return article;
  }
}
