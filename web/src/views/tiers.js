// Tiers and the default limit. Edits are merge patches of the fields that changed;
// changes that affect many users, remove a limit or hold anyone to a lower rate are
// confirmed with their effect, as the server previews it (?dry_run=true).

import { api, mergePatch, tierPath } from "../api.js";
import { fmtInt, fmtRateUnit, h, plural, section, table } from "../dom.js";
import { confirmEffect, FieldError, handleSubmit, toast } from "../feedback.js";
import { impactLines } from "../preview.js";
import { rateField } from "../rate-field.js";
import { enforcementField, enforcementWords, scopeField, scopeWords } from "../scope-field.js";
import { canWrite } from "../session.js";

// A rate change for at least this many users is confirmed first.
export const MANY_USERS = 10;
const TIER_NAME = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;

const rateWords = (rate) => (rate === null ? "unlimited" : fmtInt(rate));

// "1,114 users: 100 → unlimited tok/s"
export const effectLine = (numUsers, from, to) =>
  `${plural(numUsers, "user")}: ${rateWords(from)} → ${rateWords(to)} tok/s`;

export async function render(main) {
  const writer = canWrite();
  const defaultBox = h("div");
  const tiersBox = h("div");
  const editBox = h("div", { id: "tier-edit" });
  let tiers = [];
  // The default's scope (null: fleet), which tiers without their own inherit.
  let defaultScope = null;
  // The default's enforcement (null: enforce), likewise.
  let defaultEnforcement = null;
  const defaultScopeWords = () => `the default: ${scopeWords(defaultScope, "fleet")}`;
  const defaultEnforcementWords = () =>
    `the default: ${enforcementWords(defaultEnforcement, "enforce")}`;
  main.replaceChildren(
    h("h2", { class: "view-title" }, "Tiers and default limit"),
    section(
      "Default limit",
      h(
        "p",
        { class: "hint" },
        "Users with neither a tier nor an override get this rate; " +
          "users whose tier sets no scope, and users without a tier, get this scope.",
      ),
      defaultBox,
    ),
    section("Tiers", tiersBox, editBox),
  );
  if (writer) main.append(section("New tier", newTierForm()));

  function editTierForm(tier) {
    const rate = rateField({
      id: "edit-rate",
      legend: "Rate",
      value: tier.output_tokens_per_second,
    });
    const scope = scopeField({
      id: "edit-scope",
      value: tier.scope,
      inheritLabel: `Inherit (${defaultScopeWords()})`,
    });
    const enforcement = enforcementField({
      id: "edit-enforcement",
      value: tier.enforcement,
      inheritLabel: `Inherit (${defaultEnforcementWords()})`,
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
        h(
          "button",
          { type: "button", class: "secondary", onclick: () => editBox.replaceChildren() },
          "Cancel",
        ),
      ),
    );
    handleSubmit(form, async () => {
      const changes = {};
      const newRate = rate.value();
      if (newRate !== tier.output_tokens_per_second) changes.output_tokens_per_second = newRate;
      const newScope = scope.value();
      if (newScope !== tier.scope) changes.scope = newScope;
      const newEnforcement = enforcement.value();
      if (newEnforcement !== tier.enforcement) changes.enforcement = newEnforcement;
      if (description.value !== tier.description) changes.description = description.value;
      if (!Object.keys(changes).length) return `Tier ${tier.name}: nothing changed.`;
      const limitChanged = "output_tokens_per_second" in changes || "enforcement" in changes;
      // Whom it holds back, from the server (the same check as the write, nothing written).
      const preview =
        limitChanged && tier.num_users
          ? await mergePatch(`${tierPath(tier.name)}?dry_run=true`, changes)
          : null;
      if (
        preview?.num_down ||
        ("output_tokens_per_second" in changes &&
          (newRate === null || tier.num_users >= MANY_USERS))
      ) {
        const lines = [];
        if ("output_tokens_per_second" in changes)
          lines.push(effectLine(tier.num_users, tier.output_tokens_per_second, newRate));
        if (tier.num_users) lines.push("Users with their own override keep it.");
        if (preview) {
          const dflt = await api("GET", "/default-limit");
          lines.push(...impactLines(preview, { before: dflt, after: dflt }));
        }
        const ok = await confirmEffect(
          `Change the rate of tier ${tier.name}?`,
          lines,
          !("output_tokens_per_second" in changes)
            ? `Set the enforcement of ${tier.name} to ${enforcementWords(newEnforcement)}`
            : newRate === null
              ? `Make ${tier.name} unlimited`
              : `Set ${tier.name} to ${fmtInt(newRate)} tok/s`,
        );
        if (!ok) return "Not changed.";
      }
      const view = await mergePatch(tierPath(tier.name), changes);
      editBox.replaceChildren();
      await refresh();
      const said = [];
      if ("output_tokens_per_second" in changes)
        said.push(
          `rate ${fmtRateUnit(tier.output_tokens_per_second)} → ` +
            fmtRateUnit(view.output_tokens_per_second),
        );
      if ("scope" in changes)
        said.push(`scope ${scopeWords(tier.scope)} → ${scopeWords(view.scope)}`);
      if ("enforcement" in changes)
        said.push(
          `enforcement ${enforcementWords(tier.enforcement)} → ${enforcementWords(view.enforcement)}`,
        );
      if ("description" in changes) said.push("description updated");
      return `Tier ${tier.name}: ${said.join(", ")}.`;
    });
    return form;
  }

  function newTierForm() {
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
      h(
        "div",
        { class: "field" },
        h("label", { for: "new-tier-description" }, "Description (optional)"),
        description,
      ),
      h("button", { type: "submit" }, "Create tier"),
    );
    handleSubmit(form, async () => {
      const tierName = name.value.trim();
      if (!TIER_NAME.test(tierName)) {
        throw new FieldError(
          "name",
          tierName
            ? "Name: use up to 64 letters, digits, “.”, “_” or “-”, " +
                "starting with a letter or digit."
            : "Name: enter a name for the tier.",
        );
      }
      const value = rate.value();
      if (tiers.some((t) => t.name === tierName))
        throw new FieldError(
          "name",
          `Name: tier ${tierName} already exists; use “Edit tier ${tierName}”.`,
        );
      await api("PUT", tierPath(tierName), {
        output_tokens_per_second: value,
        description: description.value,
        scope: scope.value(),
        enforcement: enforcement.value(),
      });
      form.reset();
      rate.input.value = "";
      await refresh();
      return `Tier ${tierName} created (${fmtRateUnit(value)}).`;
    });
    return form;
  }

  function defaultForm(current, currentScope, currentEnforcement) {
    const rate = rateField({ id: "default-rate", legend: "Default rate", value: current });
    const scope = scopeField({
      id: "default-scope",
      value: currentScope,
      inheritLabel: "Not set (fleet)",
    });
    const enforcement = enforcementField({
      id: "default-enforcement",
      value: currentEnforcement,
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
      const value = rate.value();
      const newScope = scope.value();
      const newEnforcement = enforcement.value();
      const enforcementChanged = newEnforcement !== currentEnforcement;
      if (value === current && newScope === currentScope && !enforcementChanged)
        return "Default limit: nothing changed.";
      const enforcementLine =
        `enforcement ${enforcementWords(currentEnforcement, "enforce")} → ` +
        enforcementWords(newEnforcement, "enforce");
      const lines = [];
      if (value !== current)
        lines.push(
          "Every user without a tier or an override: " +
            `${rateWords(current)} → ${rateWords(value)} tok/s`,
        );
      if (newScope !== currentScope)
        lines.push(
          "Every user without a scope of its own or its tier's: scope " +
            `${scopeWords(currentScope, "fleet")} → ${scopeWords(newScope, "fleet")}`,
        );
      if (enforcementChanged)
        lines.push(
          `Every user without an enforcement of its own or its tier's: ${enforcementLine}`,
        );
      lines.push("This includes users nobody has configured yet.");
      const after = {
        output_tokens_per_second: value,
        scope: newScope,
        enforcement: newEnforcement,
      };
      // The configured users it changes and those seen in the last hour without a record.
      const preview = await api("PUT", "/default-limit?dry_run=true", after);
      lines.push(
        ...impactLines(preview, {
          before: { output_tokens_per_second: current, enforcement: currentEnforcement },
          after,
        }),
      );
      const ok = await confirmEffect(
        "Change the default limit?",
        lines,
        value !== current
          ? value === null
            ? "Make the default unlimited"
            : `Set the default to ${fmtInt(value)} tok/s`
          : newScope !== currentScope
            ? `Set the default scope to ${scopeWords(newScope, "fleet")}`
            : `Set the default enforcement to ${enforcementWords(newEnforcement, "enforce")}`,
      );
      if (!ok) return "Not changed.";
      // A PUT replaces all three: the enforcement is sent even when unchanged.
      await api("PUT", "/default-limit", after);
      await refresh(true);
      const said = [];
      if (value !== current) said.push(`${fmtRateUnit(current)} → ${fmtRateUnit(value)}`);
      if (newScope !== currentScope)
        said.push(`scope ${scopeWords(currentScope, "fleet")} → ${scopeWords(newScope, "fleet")}`);
      if (enforcementChanged) said.push(enforcementLine);
      return `Default limit: ${said.join(", ")}.`;
    });
    return form;
  }

  let shownDefault;
  async function refreshDefault(force = false) {
    const {
      output_tokens_per_second: rate,
      scope,
      enforcement,
    } = await api("GET", "/default-limit");
    defaultScope = scope;
    defaultEnforcement = enforcement;
    const key = JSON.stringify([rate, scope, enforcement]);
    if (!force && key === shownDefault) return;
    shownDefault = key;
    defaultBox.replaceChildren(
      ...[
        h(
          "p",
          { id: "default-current" },
          `Now: ${fmtRateUnit(rate)}, scope ${scopeWords(scope, "fleet")}` +
            (enforcement === "shadow" ? ", in shadow (counted, not enforced)" : ""),
        ),
        writer ? defaultForm(rate, scope, enforcement) : null,
      ].filter(Boolean),
    );
  }

  async function deleteTier(tier) {
    if (tier.num_users) {
      await confirmEffect(
        `Tier ${tier.name} cannot be deleted`,
        [`${plural(tier.num_users, "user")} still in it: move them to another tier first.`],
        "OK",
      );
      return;
    }
    const ok = await confirmEffect(
      `Delete tier ${tier.name}?`,
      [`Tier ${tier.name} (${fmtRateUnit(tier.output_tokens_per_second)}) has no users.`],
      `Delete ${tier.name}`,
    );
    if (!ok) return;
    try {
      await api("DELETE", tierPath(tier.name));
      toast(`Tier ${tier.name} deleted.`);
    } catch (error) {
      toast(error.message, "error");
    }
    await refresh();
  }

  async function refresh(forceDefault = false) {
    const [{ items }] = await Promise.all([api("GET", "/tiers"), refreshDefault(forceDefault)]);
    tiers = items;
    tiersBox.replaceChildren(
      items.length
        ? table(
            "tiers",
            ["Name", "Rate", "Scope", "Description", "Users", ...(writer ? ["Actions"] : [])],
            items.map((t) =>
              h(
                "tr",
                { dataset: { tier: t.name } },
                h("td", {}, t.name),
                h(
                  "td",
                  {},
                  fmtRateUnit(t.output_tokens_per_second) +
                    ((t.enforcement ?? defaultEnforcement) === "shadow" ? " (shadow)" : ""),
                ),
                h(
                  "td",
                  {},
                  t.scope ?? `${scopeWords(defaultScope, "fleet")} (inherited from the default)`,
                ),
                h("td", {}, t.description || ""),
                h("td", {}, fmtInt(t.num_users)),
                writer
                  ? h(
                      "td",
                      { class: "actions" },
                      h(
                        "button",
                        {
                          type: "button",
                          class: "secondary",
                          "aria-label": `Edit tier ${t.name}`,
                          onclick: () => {
                            editBox.replaceChildren(editTierForm(t));
                            editBox.querySelector("h3").focus();
                          },
                        },
                        "Edit",
                      ),
                      h(
                        "button",
                        {
                          type: "button",
                          class: "danger",
                          "aria-label": `Delete tier ${t.name}`,
                          onclick: () => deleteTier(t),
                        },
                        "Delete",
                      ),
                    )
                  : null,
              ),
            ),
            { id: "tiers" },
            { stack: true },
          )
        : h("p", { class: "hint" }, "No tiers yet."),
    );
  }
  await refresh();
  return { refresh, interval: 5000 };
}
