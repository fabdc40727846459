// The default limit: what users with neither a tier nor an override get, and the scope,
// enforcement and borrowing ceiling of users whose tier sets none. A change is confirmed with whom it holds
// back, as the server previews it. The preview and the save carry the default's ETag as
// drawn (If-Match): if someone else saved the default since, nothing is written and the
// operator sees what changed and redoes or discards (web/src/conflict.js).

import { api, ConflictError, request } from "../../api.js";
import { conflictWords, showConflict } from "../../conflict.js";
import { fmtInt, fmtRateUnit, h, section } from "../../dom.js";
import { confirmEffect, handleSubmit } from "../../feedback.js";
import { impactLines } from "../../preview.js";
import { CEILING, ceilingField, ceilingWords, rateField } from "../../rate-field.js";
import { enforcementField, enforcementWords, scopeField, scopeWords } from "../../scope-field.js";
import { rateWords } from "./words.js";

// The confirmation's lines: what changes for whom, before the server's preview.
function changeLines(before, after) {
  const lines = [];
  if (after.output_tokens_per_second !== before.output_tokens_per_second)
    lines.push(
      "Every user without a tier or an override: " +
        `${rateWords(before.output_tokens_per_second)} → ` +
        `${rateWords(after.output_tokens_per_second)} tok/s`,
    );
  if (after.scope !== before.scope)
    lines.push(
      "Every user without a scope of its own or its tier's: scope " +
        `${scopeWords(before.scope, "fleet")} → ${scopeWords(after.scope, "fleet")}`,
    );
  if (after.enforcement !== before.enforcement)
    lines.push(
      `Every user without an enforcement of its own or its tier's: ${enforcementLine(before, after)}`,
    );
  if (after[CEILING] !== before[CEILING])
    lines.push(
      "Every user without a ceiling of its own or its tier's, whose rate is below it: " +
        ceilingLine(before, after),
    );
  lines.push("This includes users nobody has configured yet.");
  return lines;
}

const enforcementLine = (before, after) =>
  `enforcement ${enforcementWords(before.enforcement, "enforce")} → ` +
  enforcementWords(after.enforcement, "enforce");

const ceilingLine = (before, after) =>
  `borrowing ceiling ${ceilingWords(before[CEILING], "none")} → ` +
  ceilingWords(after[CEILING], "none");

// The confirm button: the first of rate, scope, enforcement and ceiling that changes.
function confirmLabel(before, after) {
  const value = after.output_tokens_per_second;
  if (value !== before.output_tokens_per_second)
    return value === null
      ? "Make the default unlimited"
      : `Set the default to ${fmtInt(value)} tok/s`;
  if (after.scope !== before.scope)
    return `Set the default scope to ${scopeWords(after.scope, "fleet")}`;
  if (after.enforcement !== before.enforcement)
    return `Set the default enforcement to ${enforcementWords(after.enforcement, "enforce")}`;
  return after[CEILING] === null
    ? "Stop borrowing by default"
    : `Set the default ceiling to ${fmtInt(after[CEILING])} tok/s`;
}

// What the toast says was saved.
function savedWords(before, after) {
  const said = [];
  if (after.output_tokens_per_second !== before.output_tokens_per_second)
    said.push(
      `${fmtRateUnit(before.output_tokens_per_second)} → ` +
        fmtRateUnit(after.output_tokens_per_second),
    );
  if (after.scope !== before.scope)
    said.push(`scope ${scopeWords(before.scope, "fleet")} → ${scopeWords(after.scope, "fleet")}`);
  if (after.enforcement !== before.enforcement) said.push(enforcementLine(before, after));
  if (after[CEILING] !== before[CEILING]) said.push(ceilingLine(before, after));
  return `Default limit: ${said.join(", ")}.`;
}

const FIELDS = [
  ["output_tokens_per_second", "Rate", fmtRateUnit],
  ["scope", "Scope", (v) => scopeWords(v, "fleet")],
  ["enforcement", "Enforcement", (v) => enforcementWords(v, "enforce")],
  [CEILING, "Borrowing ceiling", (v) => ceilingWords(v, "none")],
];

// The conflict dialog's rows: each field as drawn, as saved now, as the operator wanted.
const conflictRows = (seen, now, mine) =>
  FIELDS.map(([key, label, words]) => ({
    label,
    seen: words(seen[key]),
    now: words(now[key]),
    mine: mine[key] === seen[key] ? null : words(mine[key]),
  }));

// before: GET /default-limit as drawn, with its `etag`; onSaved: redraws the view;
// redraw(edits): draws the section again from the default now, with these values in the
// form (redone after a conflict) or none; edits: as shown instead of `before`'s.
function defaultForm(before, { onSaved, redraw, edits = null }) {
  const shown = { ...before, ...(edits || {}) };
  const rate = rateField({
    id: "default-rate",
    legend: "Default rate",
    value: shown.output_tokens_per_second,
  });
  const scope = scopeField({
    id: "default-scope",
    value: shown.scope,
    inheritLabel: "Not set (fleet)",
  });
  const enforcement = enforcementField({
    id: "default-enforcement",
    value: shown.enforcement,
    inheritLabel: "Not set (enforce)",
  });
  const ceiling = ceilingField({
    id: "default-ceiling",
    value: shown[CEILING],
    noneLabel: "No borrowing",
  });
  const form = h(
    "form",
    { id: "default-form", class: "stack" },
    edits
      ? h(
          "p",
          { class: "notice", id: "default-form-redo" },
          "Your changes, over the values saved now: not saved yet. Review them and save.",
        )
      : null,
    rate.el,
    scope.el,
    enforcement.el,
    ceiling.el,
    h("button", { type: "submit" }, "Save default limit"),
  );
  handleSubmit(form, async () => {
    const after = {
      output_tokens_per_second: rate.value(),
      scope: scope.value(),
      enforcement: enforcement.value(),
      [CEILING]: ceiling.value(),
    };
    if (
      after.output_tokens_per_second === before.output_tokens_per_second &&
      after.scope === before.scope &&
      after.enforcement === before.enforcement &&
      after[CEILING] === before[CEILING]
    )
      return "Default limit: nothing changed.";
    const ifMatch = before.etag;
    try {
      // The configured users it changes and those seen in the last hour without a record.
      const preview = await api("PUT", "/default-limit?dry_run=true", after, { ifMatch });
      const lines = [...changeLines(before, after), ...impactLines(preview, { before, after })];
      const ok = await confirmEffect(
        "Change the default limit?",
        lines,
        confirmLabel(before, after),
      );
      if (!ok) return "Not changed.";
      // A PUT replaces all four: each is sent even when unchanged.
      await api("PUT", "/default-limit", after, { ifMatch });
      await onSaved();
      return savedWords(before, after);
    } catch (error) {
      if (!(error instanceof ConflictError)) throw error;
      const { data: now } = await request("GET", "/default-limit");
      const choice = await showConflict({
        title: "The default limit changed since you opened it",
        lead:
          "Someone else saved the default limit after this page drew it. Nothing of yours " +
          "was saved. What changed is highlighted:",
        rows: conflictRows(before, now, after),
      });
      await redraw(choice === "redo" ? after : null);
      return conflictWords("The default limit", choice);
    }
  });
  return form;
}

// The "Default limit" section. refresh(force) resolves to the default; it redraws the
// section (and so its form) only when the default changed, or when forced.
export function defaultLimitSection({ writer, onSaved }) {
  const box = h("div");
  let shown;
  // edits: values to draw the form with over the default's (redone after a conflict).
  async function refresh(force = false, edits = null) {
    const { data: current, etag } = await request("GET", "/default-limit");
    const { output_tokens_per_second: rate, scope, enforcement } = current;
    const ceiling = current[CEILING];
    // The ETag too: a kept form still sends the version it was drawn from.
    const key = JSON.stringify([rate, scope, enforcement, ceiling, etag]);
    if (force || key !== shown) {
      shown = key;
      box.replaceChildren(
        ...[
          h(
            "p",
            { id: "default-current" },
            `Now: ${fmtRateUnit(rate)}, scope ${scopeWords(scope, "fleet")}` +
              (enforcement === "shadow" ? ", in shadow (counted, not enforced)" : "") +
              ((ceiling ?? null) === null ? "" : `, borrowing up to ${fmtRateUnit(ceiling)}`),
          ),
          writer
            ? defaultForm(
                { output_tokens_per_second: rate, scope, enforcement, [CEILING]: ceiling, etag },
                { onSaved, redraw: (redone) => refresh(true, redone), edits },
              )
            : null,
        ].filter(Boolean),
      );
    }
    return current;
  }
  const el = section(
    "Default limit",
    h(
      "p",
      { class: "hint" },
      "Users with neither a tier nor an override get this rate; " +
        "users whose tier sets no scope, and users without a tier, get this scope.",
    ),
    box,
  );
  return { el, refresh };
}
