// A scope control: inherit, fleet or engine. "fleet": the limit is what the user gets
// summed over every engine; "engine": each engine enforces it in full.

import { h } from "./dom.js";

// What null means where it is chosen: the user's tier or default, the default's "fleet".
export const scopeWords = (scope, inherited = "inherit") => scope ?? inherited;

// value: the own scope or null; inheritLabel: what choosing no scope means here.
export function scopeField({ id, value, inheritLabel }) {
  const select = h(
    "select",
    { id, "data-field": "scope" },
    h("option", { value: "" }, inheritLabel),
    h("option", { value: "fleet" }, "Fleet: the limit summed over every engine"),
    h("option", { value: "engine" }, "Engine: each engine enforces the limit in full"),
  );
  select.value = value || "";
  return {
    el: h("div", { class: "field" }, h("label", { for: id }, "Scope"), select),
    value: () => select.value || null,
  };
}
