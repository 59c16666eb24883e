// A small Markdown renderer for untrusted model text. It builds DOM nodes and sets only
// textContent and a few vetted attributes: no string of the model's ever becomes markup, so
// `<script>` or `<img onerror>` in an answer is shown as the characters it is.
// Covers what chat models write: paragraphs, headings, lists, quotes, rules, tables, fenced
// code (an unclosed fence while streaming is still a code block), inline code, emphasis, links.

const SAFE_LINK = /^(https?:|mailto:)/i;

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// Inline spans: code first (its content is literal), then links, bold, italics, strike-through.
const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\[([^\]\n]+)\]\(([^)\s]+)\)|\*\*([^*\n]+?)\*\*|(?<!\w)__([^_\n]+?)__(?!\w)|~~([^~\n]+?)~~|\*([^*\s][^*\n]*?)\*|(?<![\w])_([^_\s][^_\n]*?)_(?![\w])|(https?:\/\/[^\s<>()]+[^\s<>().,;:!?'"])/g;

export function renderInline(text, parent) {
  let last = 0;
  const inline = new RegExp(INLINE.source, "g");  // its own lastIndex: the calls below recurse
  for (let m; (m = inline.exec(text)); ) {
    if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
    last = m.index + m[0].length;
    if (m[1]) {
      parent.append(el("code", null, m[2].replace(/^ (.*) $/, "$1")));
    } else if (m[3] !== undefined) {
      appendLink(parent, m[3], m[4]);
    } else if (m[5] !== undefined || m[6] !== undefined) {
      renderInline(m[5] ?? m[6], parent.appendChild(el("strong")));
    } else if (m[7] !== undefined) {
      renderInline(m[7], parent.appendChild(el("del")));
    } else if (m[8] !== undefined || m[9] !== undefined) {
      renderInline(m[8] ?? m[9], parent.appendChild(el("em")));
    } else if (m[10]) {
      appendLink(parent, m[10], m[10]);
    }
  }
  if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
  return parent;
}

function appendLink(parent, label, href) {
  if (!SAFE_LINK.test(href)) {  // javascript:, data: and relative links stay text
    parent.append(document.createTextNode(`[${label}](${href})`));
    return;
  }
  const a = el("a");
  a.href = href;
  a.target = "_blank";
  a.rel = "noopener noreferrer nofollow";
  renderInline(label, a);
  parent.append(a);
}

export function codeBlock(code, language) {
  const figure = el("figure", "code");
  const bar = el("figcaption");
  bar.append(el("span", "lang", language || "text"));
  const copy = el("button", "copy-code", "Copy");
  copy.type = "button";
  copy.setAttribute("aria-label", `Copy ${language || ""} code`.replace("  ", " "));
  copy.dataset.copy = code;
  bar.append(copy);
  const pre = el("pre");
  const codeEl = el("code", null, code);
  if (language) codeEl.dataset.lang = language;
  pre.append(codeEl);
  pre.tabIndex = 0;  // scrollable region reachable by keyboard
  figure.append(bar, pre);
  return figure;
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_SEP = /^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$/;

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

export function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  renderBlocks(String(text ?? "").replace(/\r\n?/g, "\n").split("\n"), root);
  return root;
}

function renderBlocks(lines, parent) {
  let i = 0;
  let paragraph = [];
  const flush = () => {
    if (!paragraph.length) return;
    const p = el("p");
    paragraph.forEach((line, n) => {
      if (n) p.append(el("br"));
      renderInline(line.trim(), p);
    });
    parent.append(p);
    paragraph = [];
  };
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {
      flush();
      const fence = m[1];
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(fence)) body.push(lines[i++]);
      i++;  // the closing fence (or past the end while it is still streaming)
      parent.append(codeBlock(body.join("\n"), m[2]));
      continue;
    }
    if (!line.trim()) { flush(); i++; continue; }
    if ((m = line.match(HEADING))) {
      flush();
      renderInline(m[2], parent.appendChild(el(`h${Math.min(6, m[1].length + 2)}`)));
      i++;
      continue;
    }
    if (RULE.test(line)) { flush(); parent.append(el("hr")); i++; continue; }
    if (QUOTE.test(line)) {
      flush();
      const body = [];
      while (i < lines.length && (m = lines[i].match(QUOTE))) { body.push(m[1]); i++; }
      renderBlocks(body, parent.appendChild(el("blockquote")));
      continue;
    }
    if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])) {
      flush();
      const wrap = el("div", "table-wrap");
      const table = wrap.appendChild(el("table"));
      const head = table.appendChild(el("thead")).appendChild(el("tr"));
      cells(line).forEach((c) => renderInline(c, head.appendChild(el("th"))));
      const tbody = table.appendChild(el("tbody"));
      i += 2;
      while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
        const row = tbody.appendChild(el("tr"));
        cells(lines[i]).forEach((c) => renderInline(c, row.appendChild(el("td"))));
        i++;
      }
      parent.append(wrap);
      continue;
    }
    if ((m = line.match(ITEM)) && (paragraph.length === 0 || /^\s*([-*+]|1[.)])\s/.test(line))) {
      flush();
      i = renderList(lines, i, parent);
      continue;
    }
    paragraph.push(line);
    i++;
  }
  flush();
}

function indentOf(line) { return line.length - line.trimStart().length; }

function renderList(lines, start, parent) {
  const first = lines[start].match(ITEM);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const list = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
  let i = start;
  while (i < lines.length) {
    const m = lines[i].match(ITEM);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    const body = [m[3]];
    i++;
    // continuation lines and nested blocks: anything indented past the marker, blank lines inside
    while (i < lines.length) {
      const next = lines[i];
      const nested = next.match(ITEM);
      if (nested && nested[1].length <= indent) break;
      if (!next.trim()) {
        const after = lines[i + 1];  // a blank line continues the item only before an indented line
        if (after !== undefined && ITEM.test(after) && indentOf(after) === indent) { i++; break; }  // loose list
        if (after === undefined || !after.trim() || indentOf(after) <= indent) break;
      } else if (!/^\s/.test(next) && !nested) {
        break;  // a new paragraph at the list's level ends it (no lazy continuation)
      }
      body.push(next.slice(Math.min(indent + 2, indentOf(next))));
      i++;
    }
    const li = list.appendChild(el("li"));
    if (body.length === 1) renderInline(body[0], li);
    else renderBlocks(body, li);
    // a single paragraph in an item renders without its <p>, as tight lists do
    if (li.childElementCount === 1 && li.firstElementChild.tagName === "P" && li.childNodes.length === 1) {
      const p = li.firstElementChild;
      li.replaceChildren(...p.childNodes);
    }
  }
  parent.append(list);
  return i;
}
