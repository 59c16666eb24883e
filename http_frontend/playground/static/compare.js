// Side by side: one prompt streamed with two settings at once (model, adapter, temperature,
// top_p, seed per side, on top of the shared settings panel), each with its own figures.

import { Turn, renderTurn, runTurn } from "./turn.js";

const OVERRIDES = [
  ["temperature", "number", "0.05"],
  ["top_p", "number", "0.01"],
  ["seed", "number", "1"],
];

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

class Side {
  constructor(name, grid) {
    this.name = name;
    this.root = grid.appendChild(el("section", "side panel"));
    this.root.setAttribute("aria-label", `Side ${name}`);
    this.root.append(el("h2", null, `Side ${name}`));
    const form = this.root.appendChild(el("div", "grid2"));
    this.model = this.field(form, "model", () => el("select"));
    this.adapter = this.field(form, "adapter", () => {
      const input = el("input");
      input.placeholder = "none";
      input.setAttribute("list", "adapter-list");
      return input;
    });
    this.overrides = {};
    for (const [key, type, step] of OVERRIDES) {
      this.overrides[key] = this.field(form, key, () => {
        const input = el("input");
        input.type = type;
        input.step = step;
        input.placeholder = "shared";
        return input;
      });
    }
    this.output = this.root.appendChild(el("div", "answer"));
    this.output.setAttribute("aria-live", "polite");
    this.controller = null;
  }

  field(parent, key, make) {
    const label = el("label", null, key);
    const input = make();
    input.id = `compare-${this.name}-${key}`;
    input.name = key;
    label.htmlFor = input.id;
    parent.append(el("div", "field"));
    parent.lastChild.append(label, input);
    return input;
  }

  body(base) {
    const body = { ...base };
    if (this.model.value) body.model = this.model.value;
    if (this.adapter.value.trim()) body.adapter_path = this.adapter.value.trim();
    for (const [key, input] of Object.entries(this.overrides)) {
      if (input.value.trim() !== "") body[key] = key === "seed" ? parseInt(input.value, 10) : parseFloat(input.value);
    }
    return body;
  }

  async run(base) {
    const turn = new Turn();
    this.output.replaceChildren();
    this.controller = new AbortController();
    await runTurn(this.body(base), turn, { signal: this.controller.signal,
                                           onUpdate: () => renderTurn(turn, this.output) });
    this.controller = null;
  }
}

export class Compare {
  constructor({ settings, root }) {
    this.settings = settings;
    this.form = root.querySelector("#compare-form");
    this.prompt = root.querySelector("#compare-prompt");
    this.runButton = root.querySelector("#compare-run");
    this.stopButton = root.querySelector("#compare-stop");
    const grid = root.querySelector("#compare-grid");
    this.sides = [new Side("A", grid), new Side("B", grid)];
    this.sides[1].overrides.temperature.value = "1";
    this.form.addEventListener("submit", (event) => { event.preventDefault(); this.run(); });
    this.prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) { event.preventDefault(); this.run(); }
    });
    this.stopButton.addEventListener("click", () => this.sides.forEach((s) => s.controller?.abort()));
  }

  setModels(models, chosen) {
    for (const side of this.sides) {
      const keep = side.model.value || chosen;
      side.model.replaceChildren(...models.map((m) => {
        const option = el("option", null, m.id.split("/").pop());
        option.value = m.id;
        option.title = m.id;
        return option;
      }));
      side.model.value = keep;
    }
  }

  async run() {
    const text = this.prompt.value.trim();
    if (!text || this.sides.some((s) => s.controller)) return;
    let fields;
    try { fields = this.settings.requestFields(); } catch (err) {
      this.sides.forEach((s) => { s.output.textContent = err.message; });
      return;
    }
    const messages = [];
    if (this.settings.system) messages.push({ role: "system", content: this.settings.system });
    messages.push({ role: "user", content: text });
    this.runButton.disabled = true;
    this.stopButton.hidden = false;
    await Promise.all(this.sides.map((side) => side.run({ messages, ...fields })));
    this.runButton.disabled = false;
    this.stopButton.hidden = true;
  }
}
