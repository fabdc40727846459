// Small DOM helpers shared by the views.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "text") el.textContent = value;
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(el.dataset, value);
    // Through the CSSOM: the CSP (style-src 'self') refuses style attributes.
    else if (key === "style") el.style.cssText = value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

const NUMBER = new Intl.NumberFormat("en-US");
export const fmtInt = (n) => NUMBER.format(n);
export const fmtRate = (rate) =>
  rate === null || rate === undefined ? "unlimited" : `${fmtInt(rate)}`;
export const fmtRateUnit = (rate) =>
  rate === null || rate === undefined ? "unlimited" : `${fmtInt(rate)} tok/s`;
export const plural = (n, one, many = `${one}s`) => `${fmtInt(n)} ${n === 1 ? one : many}`;
export const fmtTime = (iso) => new Date(iso).toLocaleString();

// A table inside a horizontally scrolling box (narrow screens keep the page width).
// With stack: true, a phone shows each row as a small card labelled by the headers.
export function table(caption, headers, rows, attrs = {}, { stack = false } = {}) {
  for (const row of rows) {
    [...row.children].forEach((td, i) => {
      if (headers[i]) td.dataset.label = headers[i];
    });
  }
  if (stack) attrs = { ...attrs, class: `${attrs.class || ""} stack-narrow`.trim() };
  return h(
    "div",
    { class: "table-wrap" },
    h(
      "table",
      attrs,
      h("caption", { class: "visually-hidden" }, caption),
      h(
        "thead",
        {},
        h(
          "tr",
          {},
          headers.map((t) => h("th", { scope: "col" }, t)),
        ),
      ),
      h("tbody", {}, rows),
    ),
  );
}

export function section(title, ...children) {
  return h("section", { class: "card" }, h("h2", {}, title), ...children);
}
