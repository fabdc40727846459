// Scope and enforcement controls. A scope control: inherit, fleet or engine. "fleet": the
// limit is what the user gets summed over every engine; "engine": each engine enforces it
// in full.

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

// An enforcement control: inherit, enforce or shadow. "shadow": the limit is counted, not
// enforced (the users are served as if unlimited; what it would refuse shows in usage).
export const enforcementWords = (enforcement, inherited = "inherit") => enforcement ?? inherited;

// value: the own enforcement or null; inheritLabel: what choosing none means here.
export function enforcementField({ id, value, inheritLabel }) {
  const select = h(
    "select",
    { id, "data-field": "enforcement" },
    h("option", { value: "" }, inheritLabel),
    h("option", { value: "enforce" }, "Enforce: the limit holds users back"),
    h("option", { value: "shadow" }, "Shadow: count what it would hold back, hold nothing"),
  );
  select.value = value || "";
  return {
    el: h("div", { class: "field" }, h("label", { for: id }, "Enforcement"), select),
    value: () => select.value || null,
  };
}
