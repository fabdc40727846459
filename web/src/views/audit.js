// Audit log: who changed what, before and after (audit/audit-table.js); filter by target
// and its kind (deep link ?target=&target_kind=), page back to the first entry
// (?before_id=); a bulk change opens the users it changed, a page at a time.

import { api } from "../api.js";
import { h, section } from "../dom.js";
import { clearErrors, fieldError } from "../feedback.js";
import { replaceParams } from "../router.js";
import { auditTable } from "./audit/audit-table.js";

const PAGE = 100;

// target_kind (GET /audit) -> how the filter offers it ("": a user with its bulk changes)
const KINDS = {
  "": "User, with the bulk changes that touched it",
  user: "User, its own changes only",
  bulk: "Bulk changes (of a user, if given)",
  tier: "Tier",
  default: "Default limit",
  token: "Viewer token (its id)",
};

// The filter form, from the address's `params`; onSubmit() when the operator filters.
function filterForm(params, onSubmit) {
  const target = h("input", {
    id: "audit-target",
    type: "search",
    value: params.get("target") || "",
    autocomplete: "off",
    "data-field": "target",
  });
  const kind = h(
    "select",
    { id: "audit-kind", "data-field": "target_kind" },
    Object.entries(KINDS).map(([value, label]) => h("option", { value }, label)),
  );
  kind.value = params.get("target_kind") || "";
  const el = h(
    "form",
    { class: "filters", role: "search", id: "audit-filter" },
    h("div", { class: "field" }, h("label", { for: "audit-target" }, "Target"), target),
    h("div", { class: "field" }, h("label", { for: "audit-kind" }, "Kind"), kind),
    h("button", { type: "submit" }, "Filter"),
  );
  el.addEventListener("submit", (event) => {
    event.preventDefault();
    onSubmit();
  });
  return { el, filters: () => ({ target: target.value.trim(), target_kind: kind.value }) };
}

// Where the page shown is, in words: `before` (null: the newest) and the next page's.
function positionWords(before, nextBefore, numItems) {
  if (nextBefore === null) return numItems ? "The last row is the first entry." : "";
  return before === null ? "The newest entries." : "Older entries.";
}

export async function render(main, route) {
  // The page shown: entries below `before` (null: the newest), and the pages above it.
  let before = Number(route.params.get("before_id")) || null;
  let above = [];
  let nextBefore = null;
  const open = new Map();
  const box = h("div");
  const position = h("p", { id: "audit-position", class: "hint", "aria-live": "polite" });
  const newer = h("button", { type: "button", class: "secondary", id: "audit-newer" }, "← Newer");
  const older = h("button", { type: "button", class: "secondary", id: "audit-older" }, "Older →");
  const form = filterForm(route.params, () => {
    above = [];
    open.clear();
    go(null);
  });
  const go = (newBefore) => {
    before = newBefore;
    replaceParams("audit", null, { ...form.filters(), before_id: before ?? "" });
    return show();
  };
  older.addEventListener("click", () => {
    above.push(before);
    go(nextBefore);
  });
  newer.addEventListener("click", () => go(above.length ? above.pop() : null));
  main.replaceChildren(
    h("h2", { class: "view-title" }, "Audit log"),
    section(
      "Changes, newest first",
      form.el,
      box,
      h("div", { class: "row" }, newer, older, position),
    ),
  );
  async function refresh() {
    const params = new URLSearchParams({ limit: String(PAGE) });
    for (const [key, value] of Object.entries(form.filters())) if (value) params.set(key, value);
    if (before !== null) params.set("before_id", String(before));
    const page = await api("GET", `/audit?${params}`);
    nextBefore = page.next_before_id;
    box.replaceChildren(
      page.items.length
        ? auditTable(page.items, "audit log", open)
        : h("p", { class: "hint" }, "No entries."),
    );
    newer.disabled = before === null;
    // After a reload the pages above are not known: back to the newest.
    newer.textContent = before !== null && !above.length ? "← Newest" : "← Newer";
    older.disabled = nextBefore === null;
    position.textContent = positionWords(before, nextBefore, page.items.length);
  }
  // A filter the server refuses is said next to its field.
  async function show() {
    clearErrors(form.el);
    try {
      await refresh();
    } catch (error) {
      if (error.status !== 422) throw error;
      box.replaceChildren();
      fieldError(form.el, error.field, error.message);
    }
  }
  await show();
  // While a refused filter is shown, the timer leaves it (and the focus) alone.
  return {
    refresh: () => (form.el.querySelector(".field-error") ? null : refresh()),
    interval: 10000,
  };
}
