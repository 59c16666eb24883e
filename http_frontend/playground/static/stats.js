// The engine panel: /health and /stats every second (paused while the tab is hidden).
// Tokens/s is the change of the engine's tokens_generated between two polls.

import { apiFetch } from "./api.js";

const STATES = {
  healthy: "ready", ready: "ready", loading: "loading", stalled: "stalled", unhealthy: "down", draining: "draining",
};

function fmtBytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fmtDuration(s) {
  if (s == null) return "–";
  if (s < 60) return `${s.toFixed(0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

export class StatsPanel {
  constructor({ list, badge, note, interval = 1000 }) {
    this.list = list;
    this.badge = badge;
    this.note = note;
    this.interval = interval;
    this.previous = null;  // {t, tokens}
    this.rate = 0;
    this.polls = 0;
    this.timer = null;
    document.addEventListener("visibilitychange", () => { if (!document.hidden) this.poll(); });
  }

  start() { this.poll(); }

  async poll() {
    clearTimeout(this.timer);
    try {
      await this.refresh();
    } finally {
      this.timer = document.hidden ? null : setTimeout(() => this.poll(), this.interval);
    }
  }

  async refresh() {
    let health = null;
    let stats = null;
    const [h, s] = await Promise.allSettled([
      fetch("health", { cache: "no-store" }).then((r) => r.json()),
      apiFetch("stats", { quiet: true, cache: "no-store" }).then(async (r) => {
        if (r.status === 401) throw new Error("stats need the API key (Key button)");
        if (!r.ok) throw new Error(`stats: ${r.status}`);
        return r.json();
      }),
    ]);
    if (h.status === "fulfilled") health = h.value;
    if (s.status === "fulfilled") stats = s.value;
    this.note.textContent = s.status === "rejected" ? s.reason.message : "";
    this.render(health, stats);
    this.polls++;
    this.list.dataset.polls = String(this.polls);
  }

  render(health, stats) {
    const engine = health?.engine || {};
    let state = health ? (engine.state === "loading" ? "loading" : health.status) : "unhealthy";
    if (health && health.status === "healthy" && engine.state && engine.state !== "ready") state = engine.state;
    const label = STATES[state] || state;
    this.badge.dataset.state = label;
    this.badge.textContent = label;

    const now = performance.now();
    if (stats) {
      const tokens = stats.tokens_generated ?? 0;
      if (this.previous && now > this.previous.t) {
        this.rate = Math.max(0, (tokens - this.previous.tokens) / ((now - this.previous.t) / 1000));
      }
      this.previous = { t: now, tokens };
    }
    const rows = [];
    const model = stats?.model ?? health?.loaded_model;
    rows.push(["Model", model ? String(model).split("/").pop() : "none loaded", model || ""]);
    const kind = stats?.model_kind ?? health?.loaded_model_kind;
    if (kind) rows.push(["Kind", kind]);
    const adapter = stats?.adapter ?? health?.loaded_adapter;
    if (adapter) rows.push(["Adapter", adapter]);
    if (label === "loading") {
      rows.push(["Loading", `${engine.loading_model || "…"} (${fmtDuration(engine.loading_seconds)})`]);
      if (engine.downloaded_bytes != null) rows.push(["Downloaded", fmtBytes(engine.downloaded_bytes)]);
    }
    if (label === "down" && health?.error) rows.push(["Error", health.error]);
    if (stats) {
      const hits = stats.prompt_cache_hits ?? 0;
      const misses = stats.prompt_cache_misses ?? 0;
      rows.push(
        ["Running", String(stats.running ?? 0), "", "running"],
        ["Queued", String(stats.queued ?? 0), "", "queued"],
        ["Batch size", `${stats.batch_size ?? 0} (max ${stats.max_batch_size ?? 0})`],
        ["Tokens/s", this.rate.toFixed(1), "", "tokens-per-second"],
        ["Tokens generated", String(stats.tokens_generated ?? 0), "", "tokens-generated"],
        ["Cache entries", `${stats.prompt_cache_entries ?? 0} (${fmtBytes(stats.prompt_cache_bytes)})`],
        ["Cache hit rate", hits + misses ? `${((100 * hits) / (hits + misses)).toFixed(0)} % (${hits}/${hits + misses})` : "–"],
        ["Cached tokens", String(stats.cached_tokens ?? 0)],
        ["Requests done", String(stats.requests_finished ?? 0), "", "requests"],
        ["Aborted / refused", `${stats.requests_aborted ?? 0} / ${stats.requests_rejected ?? 0}`, "", "aborted"],
        ["Scheduler", stats.batching ? "batching" : "serial", stats.scheduler ?? ""],
        ["Uptime", fmtDuration(stats.uptime)],
      );
    } else if (health?.engine) {
      rows.push(["Running", String(engine.running ?? 0), "", "running"], ["Queued", String(engine.queued ?? 0), "", "queued"]);
    }
    const frag = document.createDocumentFragment();
    for (const [name, value, title, key] of rows) {
      const dt = document.createElement("dt");
      dt.textContent = name;
      const dd = document.createElement("dd");
      dd.textContent = value;
      if (title) dd.title = title;
      if (key) dd.dataset.key = key;
      frag.append(dt, dd);
    }
    this.list.replaceChildren(frag);
  }
}
