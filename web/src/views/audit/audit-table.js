// The audit log as a table: who changed what, before and after, in words. A bulk change
// opens the users it changed under its row, a page at a time (GET /audit/{id}/changes).

import { api } from "../../api.js";
import { fmtRateUnit, fmtTime, h, table } from "../../dom.js";
import { toast } from "../../feedback.js";
import { link, userLink } from "../../router.js";

const DETAIL_PAGE = 100;
const HEADERS = ["When", "Who", "What", "Target", "Before", "After"];

// Each field of a record in words (a field not here is named by its key and value).
const FIELD_WORDS = {
  tier: (v) => (v === null ? "no tier" : `tier ${v}`),
  output_tokens_per_second: (v, action) =>
    /limit/.test(action)
      ? v === null
        ? "no override"
        : `override ${fmtRateUnit(v)}`
      : `rate ${fmtRateUnit(v)}`,
  // The default's null is "fleet" and "enforce"; a user's or tier's inherits.
  scope: (v, action) => `scope ${v ?? (/default/.test(action) ? "fleet (not set)" : "inherited")}`,
  enforcement: (v, action) =>
    `enforcement ${v ?? (/default/.test(action) ? "enforce (not set)" : "inherited")}`,
  // The default's null borrows nothing; a user's or tier's inherits.
  ceiling_output_tokens_per_second: (v, action) =>
    `ceiling ${v === null ? (/default/.test(action) ? "none" : "inherited") : fmtRateUnit(v)}`,
  description: (v) => (v ? `description “${v}”` : "no description"),
  name: (v) => `name ${v}`,
  prefix: (v) => `API key ${v}`,
  revoked: (v) => (v ? "revoked" : "active"),
};
// Named only when set, or when the change set or cleared them (null inherits: a record
// that never set them reads as it did before they existed).
const QUIET_WHEN_NULL = new Set(["scope", "enforcement", "ceiling_output_tokens_per_second"]);

// A record as words, every field that differs from `other` (the other side of the
// change) included, so Before and After never read alike when they are not:
// {"tier": "pro", "output_tokens_per_second": 7, "scope": "engine"}
//   -> "tier pro, override 7 tok/s, scope engine".
function describe(action, value, other = null) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "object") return String(value);
  const compared = other !== null && typeof other === "object";
  const parts = [];
  for (const [key, v] of Object.entries(value)) {
    const changed = compared && JSON.stringify(other[key]) !== JSON.stringify(v);
    if (v === null && QUIET_WHEN_NULL.has(key) && !changed) continue;
    const words = FIELD_WORDS[key];
    parts.push(words ? words(v, action) : `${key.replace(/_/g, " ")} ${JSON.stringify(v)}`);
  }
  return parts.join(", ");
}

// Both sides of a change in words.
const describeBoth = (action, before, after) => [
  describe(action, before, after),
  describe(action, after, before),
];

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
          h("td", { dataset: { label: "User" } }, userLink(c.target)),
          ...describeBoth(entry.action, c.before, c.after).map((words, i) =>
            h("td", { dataset: { label: i ? "After" : "Before" } }, words),
          ),
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
  if (kind === "user") return userLink(target);
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
  if (entry.target_kind !== "bulk") return describeBoth(entry.action, entry.before, entry.after);
  if (entry.change) return describeBoth(entry.action, entry.change.before, entry.change.after);
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
