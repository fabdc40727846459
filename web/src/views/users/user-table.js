// The configured users, one row each: id (opening its page), tier, override, the rate it
// gets (and whether in shadow), where that comes from, and its scope.

import { fmtRateUnit, h, table } from "../../dom.js";
import { userLink } from "../../router.js";

function userRow(u) {
  const shadow =
    u.effective_enforcement === "shadow" && u.effective_output_tokens_per_second !== null;
  return h(
    "tr",
    { dataset: { user: u.user } },
    h("td", {}, userLink(u.user, { "aria-label": `Open user ${u.user}` })),
    h("td", {}, u.tier || "–"),
    h(
      "td",
      {},
      u.output_tokens_per_second === null ? "–" : fmtRateUnit(u.output_tokens_per_second),
    ),
    h("td", {}, fmtRateUnit(u.effective_output_tokens_per_second) + (shadow ? " (shadow)" : "")),
    h("td", {}, u.source),
    h("td", {}, u.scope === null ? `${u.effective_scope} (inherited)` : u.effective_scope),
  );
}

export function usersTable(items) {
  if (!items.length) return h("p", { class: "hint" }, "No configured user matches.");
  return table(
    "configured users",
    ["User", "Tier", "Override", "Effective", "From", "Scope"],
    items.map(userRow),
    { id: "users" },
    { stack: true },
  );
}
