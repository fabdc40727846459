// The user's limit form: its tier, own override, scope and enforcement. Saving sends a
// merge patch of what changed (a change that makes the user unlimited is confirmed
// first); removing the record is confirmed with the default it then gets.

import { api, mergePatch, userPath } from "../../api.js";
import { fmtRateUnit, h } from "../../dom.js";
import { confirmEffect, handleSubmit, toast } from "../../feedback.js";
import { rateField } from "../../rate-field.js";
import { enforcementField, enforcementWords, scopeField, scopeWords } from "../../scope-field.js";

const overrideWords = (rate) => (rate === null ? "none" : fmtRateUnit(rate));

// The fields whose value differs from the record (a FieldError if one is not valid).
function changesOf(view, { tier, override, scope, enforcement }) {
  const changes = {};
  const newTier = tier.value || null;
  const newOverride = override.value();
  const newScope = scope.value();
  if (newTier !== view.tier) changes.tier = newTier;
  if (newOverride !== view.output_tokens_per_second) changes.output_tokens_per_second = newOverride;
  if (newScope !== view.scope) changes.scope = newScope;
  const newEnforcement = enforcement.value();
  if (newEnforcement !== view.enforcement) changes.enforcement = newEnforcement;
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
  const now = fmtRateUnit(saved.effective_output_tokens_per_second);
  return `User ${user}: ${said.join(", ")}; now ${now} (${saved.effective_scope} scope).`;
}

// defaultRate: what the user gets once its record is gone.
async function removeUser(user, view, defaultRate, refresh) {
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
    await api("DELETE", userPath(user));
    toast(`User ${user} removed: the default limit (${fmtRateUnit(defaultRate)}) applies.`);
    await refresh(true);
  } catch (error) {
    toast(error.message, "error");
  }
}

// view: GET /limits/{user} (with `configured`); inherit: the tiers and default as the
// form is drawn (its choices and labels); latest(): as of the last refresh, which saving
// and removing read (the form is kept while the operator types); refresh(force) redraws.
export function limitForm(user, view, { inherit, latest, refresh }) {
  const tier = h(
    "select",
    { id: "user-tier", "data-field": "tier" },
    h("option", { value: "" }, "(no tier: the default applies)"),
    inherit.tiers.map((t) =>
      h("option", { value: t.name }, `${t.name} (${fmtRateUnit(t.output_tokens_per_second)})`),
    ),
  );
  tier.value = view.tier || "";
  const override = rateField({
    id: "user-override",
    legend: "Own override",
    value: view.output_tokens_per_second,
    noneLabel: "No override (the tier's or the default rate)",
  });
  const scope = scopeField({
    id: "user-scope",
    value: view.scope,
    inheritLabel: `Inherit (${inherit.scopeFrom(view.tier)})`,
  });
  const enforcement = enforcementField({
    id: "user-enforcement",
    value: view.enforcement,
    inheritLabel: `Inherit (${inherit.enforcementFrom(view.tier)})`,
  });
  const el = h(
    "form",
    { id: "user-form", class: "stack" },
    h("div", { class: "field" }, h("label", { for: "user-tier" }, "Tier"), tier),
    override.el,
    scope.el,
    enforcement.el,
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
              onclick: () => removeUser(user, view, latest().defaultRate, refresh),
            },
            "Remove tier and override",
          )
        : null,
    ),
  );
  handleSubmit(el, async () => {
    const changes = changesOf(view, { tier, override, scope, enforcement });
    if (!Object.keys(changes).length) return `User ${user}: nothing changed.`;
    const before = view.effective_output_tokens_per_second;
    const next = { ...view, ...changes }; // the record as saving leaves it
    const after = latest().rate(next.tier, next.output_tokens_per_second);
    if (after === null && before !== null) {
      const ok = await confirmEffect(
        `Remove the limit of ${user}?`,
        [`${user}: ${fmtRateUnit(before)} → unlimited`],
        `Make ${user} unlimited`,
      );
      if (!ok) return "Not changed.";
    }
    const saved = await mergePatch(userPath(user), changes);
    await refresh(true);
    return savedWords(user, view, saved, changes);
  });
  return el;
}
