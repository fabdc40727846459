// The tiers table: each tier's rate (and shadow, and the ceiling its users may borrow up
// to), scope, description and number of users; for an admin, its Edit and Delete buttons.

import { fmtInt, fmtRateUnit, h, table } from "../../dom.js";
import { CEILING } from "../../rate-field.js";
import { scopeWords } from "../../scope-field.js";

function actionsCell(tier, { onEdit, onDelete }) {
  return h(
    "td",
    { class: "actions" },
    h(
      "button",
      {
        type: "button",
        class: "secondary",
        "aria-label": `Edit tier ${tier.name}`,
        onclick: () => onEdit(tier),
      },
      "Edit",
    ),
    h(
      "button",
      {
        type: "button",
        class: "danger",
        "aria-label": `Delete tier ${tier.name}`,
        onclick: () => onDelete(tier),
      },
      "Delete",
    ),
  );
}

// The ceiling the tier's users without their own borrow up to (its own, else the
// default's), in words; "" when it borrows nothing (none, or not above the rate).
function ceilingNote(tier, defaults) {
  const rate = tier.output_tokens_per_second;
  const ceiling = tier[CEILING] ?? defaults.ceiling;
  if (rate === null || ceiling === null || ceiling === undefined || ceiling <= rate) return "";
  return `, borrows up to ${fmtRateUnit(ceiling)}`;
}

// defaults: the default's scope, enforcement and ceiling, which a tier without its own
// inherits.
function tierRow(tier, { writer, defaults, ...actions }) {
  return h(
    "tr",
    { dataset: { tier: tier.name } },
    h("td", {}, tier.name),
    h(
      "td",
      {},
      fmtRateUnit(tier.output_tokens_per_second) +
        ((tier.enforcement ?? defaults.enforcement) === "shadow" ? " (shadow)" : "") +
        ceilingNote(tier, defaults),
    ),
    h(
      "td",
      {},
      tier.scope ?? `${scopeWords(defaults.scope, "fleet")} (inherited from the default)`,
    ),
    h("td", {}, tier.description || ""),
    h("td", {}, fmtInt(tier.num_users)),
    writer ? actionsCell(tier, actions) : null,
  );
}

// options: {writer, defaults, onEdit(tier), onDelete(tier)}.
export function tiersTable(tiers, options) {
  if (!tiers.length) return h("p", { class: "hint" }, "No tiers yet.");
  return table(
    "tiers",
    ["Name", "Rate", "Scope", "Description", "Users", ...(options.writer ? ["Actions"] : [])],
    tiers.map((tier) => tierRow(tier, options)),
    { id: "tiers" },
    { stack: true },
  );
}
