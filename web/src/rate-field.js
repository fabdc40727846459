// A rate control where "unlimited" (or "no override") is an explicit choice, never an
// empty box: two radio buttons, the first with a text box for tokens per second.
// Text, not type=number: letters are shown and refused instead of silently dropped.

import { fmtRateUnit, h } from "./dom.js";
import { FieldError } from "./feedback.js";

export const MAX_RATE = 1_000_000;

export function parseRate(text) {
  const clean = text.trim().replace(/[,_\s]/g, "");
  if (!/^\d+$/.test(clean)) return null;
  const n = Number(clean);
  return n >= 1 && n <= MAX_RATE ? n : null;
}

// value: current rate (number) or null; noneLabel: what null means here; limitLabel: the
// label of the number's choice.
export function rateField({
  id,
  legend,
  value,
  noneLabel = "Unlimited",
  field = "output_tokens_per_second",
  fresh = false,
  limitLabel = "Limit",
}) {
  const limitRadio = h("input", { type: "radio", name: id, id: `${id}-limited`, value: "limited" });
  const noneRadio = h("input", { type: "radio", name: id, id: `${id}-none`, value: "none" });
  const input = h("input", {
    type: "text",
    inputmode: "numeric",
    id: `${id}-rate`,
    autocomplete: "off",
    size: 9,
    "aria-label": `${legend}: tokens per second`,
  });
  if (value === null || value === undefined) {
    if (fresh) limitRadio.checked = true;
    else noneRadio.checked = true;
  } else {
    limitRadio.checked = true;
    input.value = String(value);
  }
  input.addEventListener("input", () => {
    limitRadio.checked = true;
  });
  const el = h(
    "fieldset",
    { class: "field rate-field", "data-field": field },
    h("legend", {}, legend),
    h(
      "div",
      { class: "row" },
      limitRadio,
      h("label", { for: limitRadio.id }, limitLabel),
      input,
      h("span", { class: "unit" }, "tok/s"),
    ),
    h("div", { class: "row" }, noneRadio, h("label", { for: noneRadio.id }, noneLabel)),
  );
  return {
    el,
    input,
    // The chosen rate (null = the none choice); FieldError on anything else.
    value() {
      if (noneRadio.checked) return null;
      if (!limitRadio.checked)
        throw new FieldError(field, `${legend}: choose a rate or ${noneLabel.toLowerCase()}.`);
      const rate = parseRate(input.value);
      if (rate === null) {
        throw new FieldError(
          field,
          `${legend}: enter a whole number of tokens per second from 1 to 1,000,000` +
            (input.value.trim() === ""
              ? `, or choose “${noneLabel}”.`
              : ` (“${input.value.trim()}” is not one).`),
        );
      }
      return rate;
    },
  };
}

// A ceiling: output tokens/s a user may reach above its rate by borrowing capacity no
// other user needs (at least the rate; the server refuses one below it). Null inherits
// (the default's: no borrowing).
export const CEILING = "ceiling_output_tokens_per_second";

// A ceiling in words; `unset`: what null means where it is shown.
export const ceilingWords = (ceiling, unset = "inherit") =>
  ceiling === null || ceiling === undefined ? unset : fmtRateUnit(ceiling);

// value: the own ceiling or null; noneLabel: what choosing none means here.
export const ceilingField = ({ id, value, noneLabel }) =>
  rateField({
    id,
    legend: "Borrowing ceiling",
    value,
    noneLabel,
    field: CEILING,
    limitLabel: "Up to",
  });
