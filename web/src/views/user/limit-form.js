// The user's limit form: its tier, own override, scope, enforcement and borrowing
// ceiling. Saving sends a
// merge patch of what changed (a change that makes the user unlimited is confirmed
// first, as the server previews it); removing the record is confirmed with the default
// it then gets. Every write and preview carries the If-Match of the record the form was
// drawn from: if someone else saved the user since, nothing is written and the operator
// sees what changed and redoes or discards (web/src/conflict.js). So a save that went
// through replaced exactly the record the form showed: its "before" is the server's.

import { api, ConflictError, mergePatch, userPath } from "../../api.js";
import { conflictWords, showConflict } from "../../conflict.js";
import { fmtRateUnit, h } from "../../dom.js";
import { confirmEffect, handleSubmit, toast } from "../../feedback.js";
import { cutLine } from "../../preview.js";
import { CEILING, ceilingField, ceilingWords, rateField } from "../../rate-field.js";
import { enforcementField, enforcementWords, scopeField, scopeWords } from "../../scope-field.js";

const overrideWords = (rate) => (rate === null ? "none" : fmtRateUnit(rate));

// The record's fields as the conflict dialog names them, each with its words.
const FIELDS = [
  ["tier", "Tier", (v) => v || "none"],
  ["output_tokens_per_second", "Own override", overrideWords],
  ["scope", "Scope", (v) => scopeWords(v)],
  ["enforcement", "Enforcement", (v) => enforcementWords(v)],
  [CEILING, "Borrowing ceiling", (v) => ceilingWords(v)],
];

// The rows of the conflict dialog: each field as drawn, as saved now, as the operator
// wanted it (`changes`; "remove" for a removal), then the limit the user gets now.
function conflictRows(seen, now, changes) {
  const rows = FIELDS.map(([key, label, words]) => ({
    label,
    seen: words(seen[key]),
    now: words(now[key]),
    mine: changes === "remove" ? "removed" : key in changes ? words(changes[key]) : null,
  }));
  const limit = (v) =>
    `${fmtRateUnit(v.effective_output_tokens_per_second)} (${v.effective_scope}, ` +
    `${v.effective_enforcement})`;
  rows.push({ label: "Limit in force", seen: limit(seen), now: limit(now), mine: null });
  return rows;
}

// A save that moves the rate the user is held to or its scope, and is confirmed first:
// the dialog's title by what changes (null: no confirmation). `change` is the server's
// comparison of the held rate (a shadow limit holds nobody); `before` is null for a user
// without a record (the default applied).
function confirmTitle(user, item) {
  const { before, after, change } = item;
  if (after && change === "up" && after.effective_enforcement === "shadow")
    return `Put ${user} in shadow?`;
  if (after && change === "up" && after.effective_output_tokens_per_second === null)
    return `Remove the limit of ${user}?`;
  if (before?.effective_enforcement === "shadow" && after?.effective_enforcement === "enforce")
    return `Enforce the limit of ${user}?`;
  if (before && after && before.effective_scope !== after.effective_scope)
    return `Change the scope of ${user}?`;
  return null;
}

// The dialog's lines: the held rate before and after (the server's), and a scope move.
function confirmLines(item, dflt) {
  const lines = [cutLine(item, { before: dflt, after: dflt })];
  const { before, after } = item;
  if (before && after && before.effective_scope !== after.effective_scope)
    lines.push(
      `Scope ${before.effective_scope} → ${after.effective_scope}: ` +
        (after.effective_scope === "engine"
          ? "each engine enforces the rate in full (a user on k engines may get k times it)."
          : "the rate is shared by every engine serving the user."),
    );
  return lines;
}

// After a refused write: the dialog, then the form redrawn from the record as saved now,
// with the operator's changes put back in it if they chose to redo them.
async function resolveConflict(user, view, changes, { loadView, refresh }) {
  const now = await loadView(user);
  const choice = await showConflict({
    title: `User ${user} changed since you opened it`,
    lead:
      "Someone else saved this user after this page drew it. Nothing of yours was saved. " +
      "What changed is highlighted:",
    rows: conflictRows(view, now, changes),
  });
  const redo = choice === "redo" && changes !== "remove";
  await refresh(true, redo ? changes : null);
  return conflictWords(`User ${user}`, choice);
}

// The fields whose value differs from the record (a FieldError if one is not valid).
function changesOf(view, { tier, override, scope, enforcement, ceiling }) {
  const changes = {};
  const newTier = tier.value || null;
  const newOverride = override.value();
  const newScope = scope.value();
  if (newTier !== view.tier) changes.tier = newTier;
  if (newOverride !== view.output_tokens_per_second) changes.output_tokens_per_second = newOverride;
  if (newScope !== view.scope) changes.scope = newScope;
  const newEnforcement = enforcement.value();
  if (newEnforcement !== view.enforcement) changes.enforcement = newEnforcement;
  const newCeiling = ceiling.value();
  if (newCeiling !== view[CEILING]) changes[CEILING] = newCeiling;
  return changes;
}

// What the toast says was saved: each change, and the rate and scope the user now gets.
function savedWords(user, view, saved, changes) {
  const said = [];
  if ("tier" in changes) said.push(`tier ${view.tier || "none"} → ${saved.tier || "none"}`);
  if ("output_tokens_per_second" in changes)
    said.push(
      `override ${overrideWords(view.output_tokens_per_second)} → ` +
        overrideWords(saved.output_tokens_per_second),
    );
  if ("scope" in changes) said.push(`scope ${scopeWords(view.scope)} → ${scopeWords(saved.scope)}`);
  if ("enforcement" in changes)
    said.push(
      `enforcement ${enforcementWords(view.enforcement)} → ${enforcementWords(saved.enforcement)}`,
    );
  if (CEILING in changes)
    said.push(`ceiling ${ceilingWords(view[CEILING])} → ${ceilingWords(saved[CEILING])}`);
  const now = fmtRateUnit(saved.effective_output_tokens_per_second);
  return `User ${user}: ${said.join(", ")}; now ${now} (${saved.effective_scope} scope).`;
}

// defaultRate: what the user gets once its record is gone.
async function removeUser(user, view, defaultRate, { loadView, refresh }) {
  const parts = [
    view.tier ? `tier ${view.tier}` : null,
    view.output_tokens_per_second !== null
      ? `override ${fmtRateUnit(view.output_tokens_per_second)}`
      : null,
  ].filter(Boolean);
  const ok = await confirmEffect(
    `Remove ${user}'s tier and override?`,
    [
      `${user}: ${parts.join(" and ") || "its record"} removed.`,
      `${user} then gets the default limit: ` +
        `${fmtRateUnit(view.effective_output_tokens_per_second)} → ${fmtRateUnit(defaultRate)}.`,
    ],
    `Remove ${user}`,
  );
  if (!ok) return;
  try {
    await api("DELETE", userPath(user), undefined, { ifMatch: view.etag });
    toast(`User ${user} removed: the default limit (${fmtRateUnit(defaultRate)}) applies.`);
    await refresh(true);
  } catch (error) {
    if (error instanceof ConflictError)
      toast(await resolveConflict(user, view, "remove", { loadView, refresh }), "error");
    else toast(error.message, "error");
  }
}

// view: GET /limits/{user} (with `configured` and its `etag`); inherit: the tiers and
// default as the form is drawn (its choices and labels); latest(): as of the last
// refresh, which saving and removing read (the form is kept while the operator types);
// refresh(force, edits) redraws; loadView(user): the user's view now, with its ETag;
// edits: fields shown with these values instead of the record's (redone after a
// conflict, not yet saved).
export function limitForm(user, view, { inherit, latest, refresh, loadView, edits = null }) {
  const shown = { ...view, ...(edits || {}) };
  const tier = h(
    "select",
    { id: "user-tier", "data-field": "tier" },
    h("option", { value: "" }, "(no tier: the default applies)"),
    inherit.tiers.map((t) =>
      h("option", { value: t.name }, `${t.name} (${fmtRateUnit(t.output_tokens_per_second)})`),
    ),
  );
  tier.value = shown.tier || "";
  const override = rateField({
    id: "user-override",
    legend: "Own override",
    value: shown.output_tokens_per_second,
    noneLabel: "No override (the tier's or the default rate)",
  });
  const scope = scopeField({
    id: "user-scope",
    value: shown.scope,
    inheritLabel: `Inherit (${inherit.scopeFrom(view.tier)})`,
  });
  const enforcement = enforcementField({
    id: "user-enforcement",
    value: shown.enforcement,
    inheritLabel: `Inherit (${inherit.enforcementFrom(view.tier)})`,
  });
  const ceiling = ceilingField({
    id: "user-ceiling",
    value: shown[CEILING],
    noneLabel: `Inherit (${inherit.ceilingFrom(view.tier)})`,
  });
  const el = h(
    "form",
    { id: "user-form", class: "stack" },
    edits
      ? h(
          "p",
          { class: "notice", id: "user-form-redo" },
          "Your changes, over the values saved now: not saved yet. Review them and save.",
        )
      : null,
    h("div", { class: "field" }, h("label", { for: "user-tier" }, "Tier"), tier),
    override.el,
    scope.el,
    enforcement.el,
    ceiling.el,
    h(
      "div",
      { class: "row" },
      h("button", { type: "submit" }, `Save user ${user}`),
      view.configured
        ? h(
            "button",
            {
              type: "button",
              class: "danger",
              "aria-label": `Remove user ${user}`,
              onclick: () => removeUser(user, view, latest().defaultRate, { loadView, refresh }),
            },
            "Remove tier and override",
          )
        : null,
    ),
  );
  handleSubmit(el, async () => {
    const changes = changesOf(view, { tier, override, scope, enforcement, ceiling });
    if (!Object.keys(changes).length) return `User ${user}: nothing changed.`;
    const ifMatch = view.etag;
    try {
      // What the save does to the rate the user is held to and its scope, as the server
      // has them (the form may be older than the tier or the default): a cut, a limit
      // lifted, a shadow flip or a scope move is confirmed first.
      const path = `${userPath(user)}?dry_run=true&items_limit=1`;
      const [item] = (await mergePatch(path, changes, { ifMatch })).items;
      const confirmAs = item ? confirmTitle(user, item) : null;
      if (confirmAs) {
        const ok = await confirmEffect(
          confirmAs,
          confirmLines(item, latest().dflt),
          `Save user ${user}`,
        );
        if (!ok) return "Not changed.";
      }
      const saved = await mergePatch(userPath(user), changes, { ifMatch });
      await refresh(true);
      return savedWords(user, view, saved, changes);
    } catch (error) {
      if (!(error instanceof ConflictError)) throw error;
      return resolveConflict(user, view, changes, { loadView, refresh });
    }
  });
  return el;
}
