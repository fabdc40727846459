// The audit log as a table: who changed what, before and after, in words. A bulk change
// opens the users it changed under its row, a page at a time (GET /audit/{id}/changes).

import { api } from "../../api.js";
import { fmtRateUnit, fmtTime, h, table } from "../../dom.js";
import { toast } from "../../feedback.js";
import { link } from "../../router.js";

const DETAIL_PAGE = 100;
const HEADERS = ["When", "Who", "What", "Target", "Before", "After"];

// A record as words:
// {"tier": "pro", "output_tokens_per_second": 7} -> "tier pro, override 7 tok/s".
function describe(action, value) {
  if (value === null || value === undefined) return "–";
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

const detailId = (entry) => `audit-detail-${entry.id}`;

// The users a bulk entry changed, read a page at a time from GET /audit/{id}/changes.
function bulkDetail(entry) {
  const rows = h("tbody");
  const more = h("button", { type: "button", class: "secondary", hidden: true }, "More users");
  let after = null;
  async function load() {
    const params = new URLSearchParams({ limit: String(DETAIL_PAGE) });
    if (after !== null) params.set("after", after);
    const page = await api("GET", `/audit/${entry.id}/changes?${params}`);
    rows.append(
      ...page.items.map((c) =>
        h(
          "tr",
          { dataset: { user: c.target } },
          h(
            "td",
            { dataset: { label: "User" } },
            h("a", { href: link("users", c.target) }, c.target),
          ),
          h("td", { dataset: { label: "Before" } }, describe(entry.action, c.before)),
          h("td", { dataset: { label: "After" } }, describe(entry.action, c.after)),
        ),
      ),
    );
    after = page.next_after;
    more.hidden = after === null;
  }
  more.addEventListener("click", () => load().catch((error) => toast(error.message, "error")));
  const el = h(
    "tr",
    { class: "audit-detail", id: detailId(entry) },
    h(
      "td",
      { colspan: HEADERS.length },
      h(
        "table",
        { class: "compact" },
        h("caption", { class: "visually-hidden" }, `the users of bulk change ${entry.id}`),
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            ["User", "Before", "After"].map((t) => h("th", { scope: "col" }, t)),
          ),
        ),
        rows,
      ),
      more,
    ),
  );
  return { el, load };
}

function targetCell(entry, open) {
  const { target_kind: kind, target } = entry;
  if (kind === "user") return h("a", { href: link("users", target) }, target);
  if (kind === "tier") return h("a", { href: link("tiers") }, `tier ${target}`);
  if (kind === "token") return `viewer token ${target}`;
  if (kind !== "bulk") return target;
  const button = h(
    "button",
    {
      type: "button",
      class: "secondary",
      "aria-expanded": String(open.has(entry.id)),
      "aria-controls": detailId(entry),
    },
    `${target} ▾`,
  );
  button.addEventListener("click", async () => {
    const row = button.closest("tr");
    if (open.has(entry.id)) {
      open.get(entry.id).el.remove();
      open.delete(entry.id);
      button.setAttribute("aria-expanded", "false");
      return;
    }
    const detail = bulkDetail(entry);
    open.set(entry.id, detail);
    row.after(detail.el);
    button.setAttribute("aria-expanded", "true");
    try {
      await detail.load();
    } catch (error) {
      toast(error.message, "error");
    }
  });
  return button;
}

// A bulk entry's before/after: what it did to the user the list is filtered by, if any.
function sides(entry) {
  if (entry.target_kind !== "bulk")
    return [describe(entry.action, entry.before), describe(entry.action, entry.after)];
  if (entry.change)
    return [
      describe(entry.action, entry.change.before),
      describe(entry.action, entry.change.after),
    ];
  const perUser = () => h("span", { class: "hint" }, "per user (open the target)");
  return [perUser(), perUser()];
}

// `open`: bulk entry id -> its opened detail, kept by the caller so that a refresh keeps
// what the operator opened (and what it loaded).
export function auditTable(items, caption = "audit log", open = new Map()) {
  const rows = [];
  for (const e of items) {
    const [before, after] = sides(e);
    rows.push(
      h(
        "tr",
        { dataset: { id: e.id, kind: e.target_kind } },
        h("td", {}, fmtTime(e.at)),
        h("td", {}, e.actor),
        h("td", {}, e.action.replace(/_/g, " ")),
        h("td", {}, targetCell(e, open)),
        h("td", {}, before),
        h("td", {}, after),
      ),
    );
    if (open.has(e.id)) rows.push(open.get(e.id).el);
  }
  return table(caption, HEADERS, rows, { id: "audit" }, { stack: true });
}
