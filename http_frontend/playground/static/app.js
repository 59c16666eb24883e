// Wires the page: theme, settings, the API-key dialog, the model picker, tabs, drag-and-drop,
// and starts the chat, compare and engine views.

import { apiKey, getJSON, setApiKey, setKeyPrompt } from "./api.js";
import { Chat, copyText, flash } from "./chat.js";
import { Compare } from "./compare.js";
import { Settings, initTheme } from "./settings.js";
import { StatsPanel } from "./stats.js";

const $ = (id) => document.getElementById(id);
const MODEL_STORE = "mlx-engined.model";

function keyDialog() {
  const dialog = $("key-dialog");
  const input = $("key-input");
  $("key-forget").addEventListener("click", () => { setApiKey(""); input.value = ""; dialog.close("forget"); });
  const open = (message) => new Promise((resolve) => {
    $("key-message").textContent = message || "";
    input.value = apiKey();
    dialog.addEventListener("close", () => {
      resolve(dialog.returnValue === "ok" && input.value.trim() ? input.value.trim() : null);
    }, { once: true });
    dialog.returnValue = "";
    dialog.showModal();
    input.focus();
  });
  setKeyPrompt(open);
  $("key-button").addEventListener("click", async () => {
    const key = await open("The key is sent as 'Authorization: Bearer …' to this server only.");
    if (key !== null) { setApiKey(key); loadModels(); }
  });
}

let models = [];
let compare = null;

function describe(m) {
  const parts = [m.kind || m.type || "text"];
  if (m.context_window) parts.push(`${Math.round(m.context_window / 1024)}K context`);
  if (m.loaded) parts.push("loaded");
  return parts.join(" · ");
}

async function loadModels() {
  const select = $("model");
  try {
    const listing = await getJSON("v1/models");
    models = listing.data || [];
  } catch (err) {
    select.replaceChildren(new Option(`models unavailable: ${err.message}`, ""));
    $("model-info").textContent = "";
    return;
  }
  const saved = localStorage.getItem(MODEL_STORE);
  select.replaceChildren(...models.map((m) => {
    const option = new Option(`${m.id.split("/").pop()} (${m.kind || m.type || "text"})`, m.id);
    option.title = m.id;
    return option;
  }));
  const loaded = models.find((m) => m.loaded);
  const pick = models.find((m) => m.id === saved) || loaded || models[0];
  if (pick) select.value = pick.id;
  showModel();
  compare?.setModels(models, select.value);
}

function showModel() {
  const m = models.find((x) => x.id === $("model").value);
  $("model-info").textContent = m ? describe(m) : "";
  $("model-info").title = m ? m.id : "";
}

function tabs() {
  const pairs = [[$("tab-chat"), $("chat-view")], [$("tab-compare"), $("compare-view")]];
  const select = (index) => pairs.forEach(([tab, panel], i) => {
    tab.setAttribute("aria-selected", String(i === index));
    tab.tabIndex = i === index ? 0 : -1;
    panel.hidden = i !== index;
    if (i === index) tab.focus();
  });
  pairs.forEach(([tab], i) => {
    tab.addEventListener("click", () => select(i));
    tab.addEventListener("keydown", (event) => {
      if (event.key === "ArrowRight" || event.key === "ArrowLeft") {
        select((i + (event.key === "ArrowRight" ? 1 : pairs.length - 1)) % pairs.length);
      }
    });
  });
}

function dragAndDrop(chat) {
  const overlay = $("drop-overlay");
  let depth = 0;
  const hasFiles = (event) => [...(event.dataTransfer?.types || [])].includes("Files");
  document.addEventListener("dragenter", (event) => { if (hasFiles(event)) { depth++; overlay.hidden = false; } });
  document.addEventListener("dragleave", () => { depth = Math.max(0, depth - 1); if (!depth) overlay.hidden = true; });
  document.addEventListener("dragover", (event) => { if (hasFiles(event)) event.preventDefault(); });
  document.addEventListener("drop", (event) => {
    if (!hasFiles(event)) return;
    event.preventDefault();
    depth = 0;
    overlay.hidden = true;
    chat.attach([...event.dataTransfer.files]);
  });
}

async function adapters() {
  try {
    const listing = await getJSON("v1/adapters");
    const list = document.createElement("datalist");
    list.id = "adapter-list";
    list.append(...(listing.data || []).map((a) => new Option(a.id, a.id)));
    document.body.append(list);
  } catch { /* no adapters, or no key yet: the field stays free text */ }
}

function main() {
  initTheme($("theme-toggle"));
  keyDialog();
  const settings = new Settings($("settings"));
  const chat = new Chat({ settings, model: () => $("model").value, root: $("chat-view") });
  compare = new Compare({ settings, root: $("compare-view") });
  window.playground = { chat, compare };  // for tests and the curious
  $("model").addEventListener("change", () => {
    localStorage.setItem(MODEL_STORE, $("model").value);
    showModel();
  });
  document.addEventListener("click", async (event) => {
    const target = event.target.closest?.(".copy-code");
    if (target) flash(target, (await copyText(target.dataset.copy)) ? "Copied" : "Copy failed");
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && chat.busy) chat.stop();
  });
  tabs();
  dragAndDrop(chat);
  new StatsPanel({ list: $("stats"), badge: $("health"), note: $("stats-error") }).start();
  loadModels().then(adapters);
  $("prompt").focus();
}

main();
