// Editing a tier: a merge patch of the fields that changed. A rate change for many users,
// a tier made unlimited, or a change that holds anyone to a lower rate (as the server
// previews it) is confirmed with its effect first.

import { api, mergePatch, tierPath } from "../../api.js";
import { fmtInt, fmtRateUnit, h } from "../../dom.js";
import { confirmEffect, handleSubmit } from "../../feedback.js";
import { impactLines } from "../../preview.js";
import { rateField } from "../../rate-field.js";
import { enforcementField, enforcementWords, scopeField, scopeWords } from "../../scope-field.js";
import { effectLine } from "./words.js";

// A rate change for at least this many users is confirmed first.
const MANY_USERS = 10;

const RATE = "output_tokens_per_second";

// The fields whose value differs from the tier's (a FieldError if one is not valid).
function changesOf(tier, { rate, scope, enforcement, description }) {
  const changes = {};
  const newRate = rate.value();
  if (newRate !== tier.output_tokens_per_second) changes.output_tokens_per_second = newRate;
  const newScope = scope.value();
  if (newScope !== tier.scope) changes.scope = newScope;
  const newEnforcement = enforcement.value();
  if (newEnforcement !== tier.enforcement) changes.enforcement = newEnforcement;
  if (description.value !== tier.description) changes.description = description.value;
  return changes;
}

// Whom the change holds back, from the server (the same check as the write, nothing
// written): only where the tier has users and its limit or enforcement changes.
function preview(tier, changes) {
  const limitChanged = RATE in changes || "enforcement" in changes;
  return limitChanged && tier.num_users
    ? mergePatch(`${tierPath(tier.name)}?dry_run=true`, changes)
    : null;
}

// Whether to save: true without asking unless the change needs a confirmation.
async function confirmed(tier, changes) {
  const impact = await preview(tier, changes);
  const newRate = changes[RATE];
  const rateNeedsIt = RATE in changes && (newRate === null || tier.num_users >= MANY_USERS);
  if (!impact?.num_down && !rateNeedsIt) return true;
  const lines = [];
  if (RATE in changes)
    lines.push(effectLine(tier.num_users, tier.output_tokens_per_second, newRate));
  if (tier.num_users) lines.push("Users with their own override keep it.");
  if (impact) {
    const dflt = await api("GET", "/default-limit");
    lines.push(...impactLines(impact, { before: dflt, after: dflt }));
  }
  return confirmEffect(
    `Change the rate of tier ${tier.name}?`,
    lines,
    !(RATE in changes)
      ? `Set the enforcement of ${tier.name} to ${enforcementWords(changes.enforcement)}`
      : newRate === null
        ? `Make ${tier.name} unlimited`
        : `Set ${tier.name} to ${fmtInt(newRate)} tok/s`,
  );
}

// What the toast says was saved: each change, from the tier as it was to as it is.
function savedWords(tier, saved, changes) {
  const said = [];
  if (RATE in changes)
    said.push(
      `rate ${fmtRateUnit(tier.output_tokens_per_second)} → ` +
        fmtRateUnit(saved.output_tokens_per_second),
    );
  if ("scope" in changes) said.push(`scope ${scopeWords(tier.scope)} → ${scopeWords(saved.scope)}`);
  if ("enforcement" in changes)
    said.push(
      `enforcement ${enforcementWords(tier.enforcement)} → ${enforcementWords(saved.enforcement)}`,
    );
  if ("description" in changes) said.push("description updated");
  return `Tier ${tier.name}: ${said.join(", ")}.`;
}

// defaults: the default's scope and enforcement (what "Inherit" means); close: removes
// the form; refresh: redraws the view.
export function editTierForm(tier, { defaults, close, refresh }) {
  const rate = rateField({
    id: "edit-rate",
    legend: "Rate",
    value: tier.output_tokens_per_second,
  });
  const scope = scopeField({
    id: "edit-scope",
    value: tier.scope,
    inheritLabel: `Inherit (the default: ${scopeWords(defaults.scope, "fleet")})`,
  });
  const enforcement = enforcementField({
    id: "edit-enforcement",
    value: tier.enforcement,
    inheritLabel: `Inherit (the default: ${enforcementWords(defaults.enforcement, "enforce")})`,
  });
  const description = h("input", {
    id: "edit-description",
    value: tier.description,
    "data-field": "description",
    maxlength: 1000,
  });
  const form = h(
    "form",
    { id: "tier-edit-form", class: "stack", "aria-labelledby": "tier-edit-title" },
    h("h3", { id: "tier-edit-title", tabindex: "-1" }, `Edit tier ${tier.name}`),
    rate.el,
    scope.el,
    enforcement.el,
    h(
      "div",
      { class: "field" },
      h("label", { for: "edit-description" }, "Description"),
      description,
    ),
    h(
      "div",
      { class: "row" },
      h("button", { type: "submit" }, `Save tier ${tier.name}`),
      h("button", { type: "button", class: "secondary", onclick: close }, "Cancel"),
    ),
  );
  handleSubmit(form, async () => {
    const changes = changesOf(tier, { rate, scope, enforcement, description });
    if (!Object.keys(changes).length) return `Tier ${tier.name}: nothing changed.`;
    if (!(await confirmed(tier, changes))) return "Not changed.";
    const saved = await mergePatch(tierPath(tier.name), changes);
    close();
    await refresh();
    return savedWords(tier, saved, changes);
  });
  return form;
}
