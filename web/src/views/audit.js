// Audit log: who changed what, before and after; filter by target (deep link ?target=).

import { api } from "../api.js";
import { fmtRateUnit, fmtTime, h, plural, section, table } from "../dom.js";
import { link, replaceParams } from "../router.js";

// A record as words:
// {"tier": "pro", "output_tokens_per_second": 7} -> "tier pro, override 7 tok/s".
export function describe(action, value) {
  if (value === null || value === undefined) return "–";
  if (action === "bulk_put_limits") return plural(Object.keys(value).length, "user");
  if (typeof value !== "object") return String(value);
  const parts = [];
  if ("tier" in value) parts.push(value.tier === null ? "no tier" : `tier ${value.tier}`);
  if ("output_tokens_per_second" in value) {
    const rate = value.output_tokens_per_second;
    if (/limit/.test(action))
      parts.push(rate === null ? "no override" : `override ${fmtRateUnit(rate)}`);
    else parts.push(`rate ${fmtRateUnit(rate)}`);
  }
  // Only an own enforcement is named (null inherits), so records of before shadow read as before.
  if (value.enforcement) parts.push(`enforcement ${value.enforcement}`);
  if ("description" in value)
    parts.push(value.description ? `description “${value.description}”` : "no description");
  if ("name" in value) parts.push(`name ${value.name}`);
  if ("prefix" in value) parts.push(`API key ${value.prefix}`);
  if ("revoked" in value) parts.push(value.revoked ? "revoked" : "active");
  return parts.join(", ");
}

function targetLink(entry) {
  if (/(limit|key)$/.test(entry.action) && entry.action !== "bulk_put_limits")
    return h("a", { href: link("users", entry.target) }, entry.target);
  if (/tier$/.test(entry.action)) return h("a", { href: link("tiers") }, entry.target);
  return entry.target;
}

export function auditTable(items, caption = "audit log") {
  return table(
    caption,
    ["When", "Who", "What", "Target", "Before", "After"],
    items.map((e) =>
      h(
        "tr",
        {},
        h("td", {}, fmtTime(e.at)),
        h("td", {}, e.actor),
        h("td", {}, e.action.replace(/_/g, " ")),
        h("td", {}, targetLink(e)),
        h("td", {}, describe(e.action, e.before)),
        h("td", {}, describe(e.action, e.after)),
      ),
    ),
    { id: "audit" },
    { stack: true },
  );
}

export async function render(main, route) {
  const target = h("input", {
    id: "audit-target",
    type: "search",
    value: route.params.get("target") || "",
    autocomplete: "off",
  });
  const box = h("div");
  const form = h(
    "form",
    { class: "row", role: "search" },
    h("label", { for: "audit-target" }, "Target (user, tier, default)"),
    target,
    h("button", { type: "submit" }, "Filter"),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    replaceParams("audit", null, { target: target.value.trim() });
    refresh();
  });
  main.replaceChildren(
    h("h2", { class: "view-title" }, "Audit log"),
    section("Changes, newest first", form, box),
  );
  async function refresh() {
    const params = new URLSearchParams({ limit: "200" });
    if (target.value.trim()) params.set("target", target.value.trim());
    const { items } = await api("GET", `/audit?${params}`);
    box.replaceChildren(
      items.length ? auditTable(items) : h("p", { class: "hint" }, "No entries."),
    );
  }
  await refresh();
  return { refresh, interval: 10000 };
}
