// The default limit: what users with neither a tier nor an override get, and the scope
// and enforcement of users whose tier sets none. A change is confirmed with whom it holds
// back, as the server previews it.

import { api } from "../../api.js";
import { fmtInt, fmtRateUnit, h, section } from "../../dom.js";
import { confirmEffect, handleSubmit } from "../../feedback.js";
import { impactLines } from "../../preview.js";
import { rateField } from "../../rate-field.js";
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
  lines.push("This includes users nobody has configured yet.");
  return lines;
}

const enforcementLine = (before, after) =>
  `enforcement ${enforcementWords(before.enforcement, "enforce")} → ` +
  enforcementWords(after.enforcement, "enforce");

// The confirm button: the first of rate, scope and enforcement that changes.
function confirmLabel(before, after) {
  const value = after.output_tokens_per_second;
  if (value !== before.output_tokens_per_second)
    return value === null
      ? "Make the default unlimited"
      : `Set the default to ${fmtInt(value)} tok/s`;
  if (after.scope !== before.scope)
    return `Set the default scope to ${scopeWords(after.scope, "fleet")}`;
  return `Set the default enforcement to ${enforcementWords(after.enforcement, "enforce")}`;
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
  return `Default limit: ${said.join(", ")}.`;
}

// before: GET /default-limit as drawn; onSaved: redraws the view.
function defaultForm(before, onSaved) {
  const rate = rateField({
    id: "default-rate",
    legend: "Default rate",
    value: before.output_tokens_per_second,
  });
  const scope = scopeField({
    id: "default-scope",
    value: before.scope,
    inheritLabel: "Not set (fleet)",
  });
  const enforcement = enforcementField({
    id: "default-enforcement",
    value: before.enforcement,
    inheritLabel: "Not set (enforce)",
  });
  const form = h(
    "form",
    { id: "default-form", class: "stack" },
    rate.el,
    scope.el,
    enforcement.el,
    h("button", { type: "submit" }, "Save default limit"),
  );
  handleSubmit(form, async () => {
    const after = {
      output_tokens_per_second: rate.value(),
      scope: scope.value(),
      enforcement: enforcement.value(),
    };
    if (
      after.output_tokens_per_second === before.output_tokens_per_second &&
      after.scope === before.scope &&
      after.enforcement === before.enforcement
    )
      return "Default limit: nothing changed.";
    // The configured users it changes and those seen in the last hour without a record.
    const preview = await api("PUT", "/default-limit?dry_run=true", after);
    const lines = [...changeLines(before, after), ...impactLines(preview, { before, after })];
    const ok = await confirmEffect("Change the default limit?", lines, confirmLabel(before, after));
    if (!ok) return "Not changed.";
    // A PUT replaces all three: the enforcement is sent even when unchanged.
    await api("PUT", "/default-limit", after);
    await onSaved();
    return savedWords(before, after);
  });
  return form;
}

// The "Default limit" section. refresh(force) resolves to the default; it redraws the
// section (and so its form) only when the default changed, or when forced.
export function defaultLimitSection({ writer, onSaved }) {
  const box = h("div");
  let shown;
  async function refresh(force = false) {
    const current = await api("GET", "/default-limit");
    const { output_tokens_per_second: rate, scope, enforcement } = current;
    const key = JSON.stringify([rate, scope, enforcement]);
    if (force || key !== shown) {
      shown = key;
      box.replaceChildren(
        ...[
          h(
            "p",
            { id: "default-current" },
            `Now: ${fmtRateUnit(rate)}, scope ${scopeWords(scope, "fleet")}` +
              (enforcement === "shadow" ? ", in shadow (counted, not enforced)" : ""),
          ),
          writer
            ? defaultForm({ output_tokens_per_second: rate, scope, enforcement }, onSaved)
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
