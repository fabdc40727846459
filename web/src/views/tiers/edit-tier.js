// Editing a tier: a merge patch of the fields that changed. A rate change for many users,
// a tier made unlimited, or a change that holds anyone to a lower rate (as the server
// previews it) is confirmed with its effect first. The form is drawn from the tier as
// GET /tiers/{name} answers it, with its ETag: the preview and the save carry it as
// If-Match, so if someone else saved the tier since, nothing is written and the operator
// sees what changed and redoes or discards (web/src/conflict.js); a save that went
// through replaced the very tier the form showed (its "before" is the server's).

import { api, ConflictError, mergePatch, request, tierPath } from "../../api.js";
import { conflictWords, showConflict } from "../../conflict.js";
import { fmtInt, fmtRateUnit, h, plural } from "../../dom.js";
import { confirmEffect, handleSubmit } from "../../feedback.js";
import { impactLines } from "../../preview.js";
import { CEILING, ceilingField, ceilingWords, rateField } from "../../rate-field.js";
import { enforcementField, enforcementWords, scopeField, scopeWords } from "../../scope-field.js";
import { effectLine } from "./words.js";

// A rate change for at least this many users is confirmed first.
const MANY_USERS = 10;

const RATE = "output_tokens_per_second";

// The fields whose value differs from the tier's (a FieldError if one is not valid).
function changesOf(tier, { rate, scope, enforcement, ceiling, description }) {
  const changes = {};
  const newRate = rate.value();
  if (newRate !== tier.output_tokens_per_second) changes.output_tokens_per_second = newRate;
  const newScope = scope.value();
  if (newScope !== tier.scope) changes.scope = newScope;
  const newEnforcement = enforcement.value();
  if (newEnforcement !== tier.enforcement) changes.enforcement = newEnforcement;
  const newCeiling = ceiling.value();
  if (newCeiling !== tier[CEILING]) changes[CEILING] = newCeiling;
  if (description.value !== tier.description) changes.description = description.value;
  return changes;
}

// The tier now, with its ETag (null: it no longer exists).
export async function loadTier(name) {
  try {
    const { data, etag } = await request("GET", tierPath(name));
    return { ...data, etag };
  } catch (error) {
    if (error.status === 404) return null;
    throw error;
  }
}

// The fields of a tier that change what its users get (its description does not).
const LIMIT_FIELDS = [RATE, "scope", "enforcement"];

// Whom the change moves, from the server (the same check as the write, nothing
// written): only where the tier has users and its rate, scope or enforcement changes.
function preview(tier, changes) {
  return LIMIT_FIELDS.some((f) => f in changes) && tier.num_users
    ? mergePatch(`${tierPath(tier.name)}?dry_run=true`, changes, { ifMatch: tier.etag })
    : null;
}

// The dialog's title: what changes ("Enforce the limit of tier trial?").
function title(tier, changes) {
  const changed = LIMIT_FIELDS.filter((f) => f in changes);
  if (changed.length === 1 && changed[0] === "enforcement") {
    if (changes.enforcement === "enforce") return `Enforce the limit of tier ${tier.name}?`;
    if (changes.enforcement === "shadow") return `Put tier ${tier.name} in shadow?`;
  }
  const words = changed.map((f) => (f === RATE ? "rate" : f));
  const list = words.length > 1 ? `${words.slice(0, -1).join(", ")} and ${words.at(-1)}` : words[0];
  return `Change the ${list} of tier ${tier.name}?`;
}

// The users whose effective scope the change moves (the preview lists every user whose
// effective rate, scope or enforcement changes).
const scopeMoves = (impact) =>
  impact.items.filter(
    (i) => i.before && i.after && i.before.effective_scope !== i.after.effective_scope,
  );

// Whether to save: true without asking unless the change needs a confirmation. What the
// dialog says comes from the server: the tier as read when the form opened (its ETag
// holds while the preview and the save run) and the preview.
async function confirmed(tier, changes) {
  const impact = await preview(tier, changes);
  const newRate = changes[RATE];
  const rateNeedsIt = RATE in changes && (newRate === null || tier.num_users >= MANY_USERS);
  const shadowFlip = "enforcement" in changes && impact && impact.num_down + impact.num_up > 0;
  const moved = impact ? scopeMoves(impact) : [];
  if (!impact?.num_down && !rateNeedsIt && !shadowFlip && !moved.length) return true;
  const lines = [];
  if (RATE in changes) {
    lines.push(effectLine(tier.num_users, tier.output_tokens_per_second, newRate));
    lines.push("Users with an override of their own keep their own rate.");
  }
  if (moved.length)
    lines.push(
      `${plural(moved.length, "user")}: scope ${moved[0].before.effective_scope} → ` +
        `${moved[0].after.effective_scope}` +
        (moved[0].after.effective_scope === "engine"
          ? " (each engine enforces the rate in full: a user on k engines may get k times it)"
          : " (the rate is shared by all engines)"),
    );
  if ("enforcement" in changes)
    lines.push(
      `Enforcement ${enforcementWords(tier.enforcement)} → ` +
        `${enforcementWords(changes.enforcement)}: for every user of the tier without one of ` +
        "its own, overrides included.",
    );
  if (impact) {
    const dflt = await api("GET", "/default-limit");
    lines.push(...impactLines(impact, { before: dflt, after: dflt }));
  }
  return confirmEffect(
    title(tier, changes),
    lines,
    RATE in changes
      ? newRate === null
        ? `Make ${tier.name} unlimited`
        : `Set ${tier.name} to ${fmtInt(newRate)} tok/s`
      : "enforcement" in changes
        ? `Set the enforcement of ${tier.name} to ${enforcementWords(changes.enforcement)}`
        : `Set the scope of ${tier.name} to ${scopeWords(changes.scope)}`,
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
  if (CEILING in changes)
    said.push(`ceiling ${ceilingWords(tier[CEILING])} → ${ceilingWords(saved[CEILING])}`);
  if ("description" in changes) said.push("description updated");
  return `Tier ${tier.name}: ${said.join(", ")}.`;
}

const FIELDS = [
  [RATE, "Rate", fmtRateUnit],
  ["scope", "Scope", (v) => scopeWords(v)],
  ["enforcement", "Enforcement", (v) => enforcementWords(v)],
  [CEILING, "Borrowing ceiling", (v) => ceilingWords(v)],
  ["description", "Description", (v) => v || "(none)"],
];

// The conflict dialog's rows: each field as drawn, as saved now (`now` null: deleted),
// as the operator wanted it.
function conflictRows(seen, now, changes) {
  const rows = FIELDS.map(([key, label, words]) => ({
    label,
    seen: words(seen[key]),
    now: now ? words(now[key]) : "(tier deleted)",
    mine: key in changes ? words(changes[key]) : null,
  }));
  rows.push({
    label: "Users",
    seen: fmtInt(seen.num_users),
    now: now ? fmtInt(now.num_users) : "–",
    mine: null,
  });
  return rows;
}

// After a refused save: the dialog, then the form drawn again from the tier as saved
// now with the operator's changes in it (redo), or closed (discard).
async function resolveConflict(tier, changes, { reopen, close, refresh }) {
  const now = await loadTier(tier.name);
  const choice = await showConflict({
    title: `Tier ${tier.name} changed since you opened it`,
    lead:
      "Someone else saved this tier after you opened the form. Nothing of yours was saved. " +
      "What changed is highlighted:",
    rows: conflictRows(tier, now, changes),
  });
  if (choice === "redo" && now) reopen(now, changes);
  else close();
  await refresh();
  return conflictWords(`Tier ${tier.name}`, choice);
}

// tier: GET /tiers/{name} with its `etag`; defaults: the default's scope, enforcement and
// ceiling (what "Inherit" means); close: removes the form; reopen(tier, edits): draws it again;
// refresh: redraws the view; edits: fields shown with these values instead of the
// tier's (redone after a conflict, not yet saved).
export function editTierForm(tier, { defaults, close, reopen, refresh, edits = null }) {
  const shown = { ...tier, ...(edits || {}) };
  const rate = rateField({
    id: "edit-rate",
    legend: "Rate",
    value: shown.output_tokens_per_second,
  });
  const scope = scopeField({
    id: "edit-scope",
    value: shown.scope,
    inheritLabel: `Inherit (the default: ${scopeWords(defaults.scope, "fleet")})`,
  });
  const enforcement = enforcementField({
    id: "edit-enforcement",
    value: shown.enforcement,
    inheritLabel: `Inherit (the default: ${enforcementWords(defaults.enforcement, "enforce")})`,
  });
  const ceiling = ceilingField({
    id: "edit-ceiling",
    value: shown[CEILING],
    noneLabel: `Inherit (the default: ${ceilingWords(defaults.ceiling, "no borrowing")})`,
  });
  const description = h("input", {
    id: "edit-description",
    value: shown.description,
    "data-field": "description",
    maxlength: 1000,
  });
  const form = h(
    "form",
    { id: "tier-edit-form", class: "stack", "aria-labelledby": "tier-edit-title" },
    h("h3", { id: "tier-edit-title", tabindex: "-1" }, `Edit tier ${tier.name}`),
    edits
      ? h(
          "p",
          { class: "notice", id: "tier-form-redo" },
          "Your changes, over the values saved now: not saved yet. Review them and save.",
        )
      : null,
    rate.el,
    scope.el,
    enforcement.el,
    ceiling.el,
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
    const changes = changesOf(tier, { rate, scope, enforcement, ceiling, description });
    if (!Object.keys(changes).length) return `Tier ${tier.name}: nothing changed.`;
    try {
      if (!(await confirmed(tier, changes))) return "Not changed.";
      const saved = await mergePatch(tierPath(tier.name), changes, { ifMatch: tier.etag });
      close();
      await refresh();
      return savedWords(tier, saved, changes);
    } catch (error) {
      if (!(error instanceof ConflictError)) throw error;
      return resolveConflict(tier, changes, { reopen, close, refresh });
    }
  });
  return form;
}
