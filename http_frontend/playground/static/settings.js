// The settings panel: sampling fields, system prompt, schema and tools, turned into request
// fields; remembered in localStorage (they hold no secret). Also the light/dark theme switch.

const STORE = "mlx-engined.settings";
const THEME = "mlx-engined.theme";
const NUMBERS = { temperature: parseFloat, top_p: parseFloat, top_k: (v) => parseInt(v, 10),
                  min_p: parseFloat, max_tokens: (v) => parseInt(v, 10), seed: (v) => parseInt(v, 10) };

export class Settings {
  constructor(form) {
    this.form = form;
    this.schemaError = document.getElementById("schema-error");
    this.toolsError = document.getElementById("tools-error");
    this.restore();
    form.addEventListener("input", () => this.save());
    form.addEventListener("change", () => this.save());
    document.getElementById("reset-settings").addEventListener("click", () => {
      form.reset();
      localStorage.removeItem(STORE);
      this.showError(this.schemaError, "");
      this.showError(this.toolsError, "");
    });
  }

  restore() {
    let saved = {};
    try { saved = JSON.parse(localStorage.getItem(STORE) || "{}"); } catch { /* ignore */ }
    for (const [name, value] of Object.entries(saved)) {
      const field = this.form.elements.namedItem(name);
      if (!field || field instanceof RadioNodeList) continue;
      if (field.type === "checkbox") field.checked = Boolean(value);
      else field.value = value;
    }
  }

  save() {
    const data = {};
    for (const field of this.form.elements) {
      if (!field.name) continue;
      data[field.name] = field.type === "checkbox" ? field.checked : field.value;
    }
    localStorage.setItem(STORE, JSON.stringify(data));
  }

  get system() { return this.form.elements.system.value.trim(); }

  showError(node, message) {
    node.textContent = message;
    node.hidden = !message;
    const details = node.closest("details");
    if (message && details) details.open = true;
  }

  // The request fields for these settings, or throws with a message naming the bad field.
  requestFields() {
    const els = this.form.elements;
    const out = {};
    for (const [name, parse] of Object.entries(NUMBERS)) {
      const raw = els[name].value.trim();
      if (raw === "") continue;
      const value = parse(raw);
      if (Number.isNaN(value)) throw new Error(`${name} must be a number`);
      out[name] = value;
    }
    const stops = els.stop.value.split("\n").filter((s) => s.length > 0);
    if (stops.length) out.stop = stops;
    this.showError(this.schemaError, "");
    const schemaText = els.schema.value.trim();
    if (schemaText) {
      let schema;
      try { schema = JSON.parse(schemaText); } catch (e) {
        this.showError(this.schemaError, `Not JSON: ${e.message}`);
        throw new Error("The JSON schema is not valid JSON");
      }
      out.response_format = { type: "json_schema", json_schema: { name: "output", schema, strict: true } };
    }
    this.showError(this.toolsError, "");
    const toolsText = els.tools.value.trim();
    if (toolsText) {
      let tools;
      try { tools = JSON.parse(toolsText); } catch (e) {
        this.showError(this.toolsError, `Not JSON: ${e.message}`);
        throw new Error("The tools are not valid JSON");
      }
      if (!Array.isArray(tools)) {
        this.showError(this.toolsError, "Expected a JSON array of tools");
        throw new Error("The tools must be a JSON array");
      }
      out.tools = tools.map((t) => (t.type ? t : { type: "function", function: t }));
      out.tool_choice = els.tool_choice.value;
      if (!els.parallel_tool_calls.checked) out.parallel_tool_calls = false;
    }
    if (els.no_thinking.checked) out.chat_template_kwargs = { enable_thinking: false };
    return out;
  }
}

// Light/dark: follows the system unless the user picked one (remembered).
export function initTheme(button) {
  const media = window.matchMedia("(prefers-color-scheme: dark)");
  const apply = () => {
    const chosen = localStorage.getItem(THEME);
    const dark = chosen ? chosen === "dark" : media.matches;
    document.documentElement.dataset.theme = dark ? "dark" : "light";
    button.setAttribute("aria-label", dark ? "Switch to light theme" : "Switch to dark theme");
    button.setAttribute("aria-pressed", String(dark));
  };
  button.addEventListener("click", () => {
    const dark = document.documentElement.dataset.theme === "dark";
    localStorage.setItem(THEME, dark ? "light" : "dark");
    apply();
  });
  media.addEventListener("change", apply);
  apply();
}
