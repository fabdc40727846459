// Creating a tier: a name, a rate and optionally its own scope, enforcement, borrowing
// ceiling and description.

import { api, tierPath } from "../../api.js";
import { fmtRateUnit, h } from "../../dom.js";
import { FieldError, handleSubmit } from "../../feedback.js";
import { CEILING, ceilingField, rateField } from "../../rate-field.js";
import { enforcementField, scopeField } from "../../scope-field.js";

const TIER_NAME = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;

// The name typed, or a FieldError saying what a name may be or that it is taken.
function checkedName(typed) {
  const name = typed.trim();
  if (!TIER_NAME.test(name)) {
    throw new FieldError(
      "name",
      name
        ? "Name: use up to 64 letters, digits, “.”, “_” or “-”, starting with a letter or digit."
        : "Name: enter a name for the tier.",
    );
  }
  return name;
}

// exists(name): whether the view shows a tier of that name; refresh: redraws the view.
export function newTierForm({ exists, refresh }) {
  const name = h("input", {
    id: "new-tier-name",
    autocomplete: "off",
    "data-field": "name",
    maxlength: 64,
  });
  const rate = rateField({ id: "new-tier-rate", legend: "Rate", value: null, fresh: true });
  const scope = scopeField({
    id: "new-tier-scope",
    value: null,
    inheritLabel: "Inherit (the default's)",
  });
  const enforcement = enforcementField({
    id: "new-tier-enforcement",
    value: null,
    inheritLabel: "Inherit (the default's)",
  });
  const ceiling = ceilingField({
    id: "new-tier-ceiling",
    value: null,
    noneLabel: "Inherit (the default's)",
  });
  const description = h("input", {
    id: "new-tier-description",
    "data-field": "description",
    maxlength: 1000,
  });
  const form = h(
    "form",
    { id: "tier-create", class: "stack" },
    h("div", { class: "field" }, h("label", { for: "new-tier-name" }, "Name"), name),
    rate.el,
    scope.el,
    enforcement.el,
    ceiling.el,
    h(
      "div",
      { class: "field" },
      h("label", { for: "new-tier-description" }, "Description (optional)"),
      description,
    ),
    h("button", { type: "submit" }, "Create tier"),
  );
  handleSubmit(form, async () => {
    const tierName = checkedName(name.value);
    const value = rate.value();
    if (exists(tierName))
      throw new FieldError(
        "name",
        `Name: tier ${tierName} already exists; use “Edit tier ${tierName}”.`,
      );
    await api("PUT", tierPath(tierName), {
      output_tokens_per_second: value,
      description: description.value,
      scope: scope.value(),
      enforcement: enforcement.value(),
      [CEILING]: ceiling.value(),
    });
    form.reset();
    rate.input.value = "";
    await refresh();
    return `Tier ${tierName} created (${fmtRateUnit(value)}).`;
  });
  return form;
}
