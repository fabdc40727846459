// The configured users: substring search, tier filter, sorting and pages, kept in the
// address (?q=&tier=&sort=&page=) so that a reload or a link shows the same page.

import { api } from "../../api.js";
import { fmtInt, h, plural, section } from "../../dom.js";
import { replaceParams } from "../../router.js";
import { usersTable } from "./user-table.js";

// Fewer rows per page on a phone.
const PAGE = matchMedia("(max-width: 600px)").matches ? 20 : 50;
const SORTS = {
  user: "User id A→Z",
  "-user": "User id Z→A",
  tier: "Tier A→Z",
  "-tier": "Tier Z→A",
  "-override": "Override high→low",
  override: "Override low→high",
};
// Typing in the search box waits this long for the next key before asking the server.
const TYPING_MS = 250;

// The search form; onChange() when what it asks for changed. `params`: the address's.
function filterForm(params, onChange) {
  const search = h("input", {
    id: "user-search",
    type: "search",
    value: params.get("q") || "",
    autocomplete: "off",
  });
  const tier = h("select", { id: "user-tier-filter" }, h("option", { value: "" }, "All tiers"));
  const sort = h(
    "select",
    { id: "user-sort" },
    Object.entries(SORTS).map(([v, t]) => h("option", { value: v }, t)),
  );
  sort.value = params.get("sort") || "user";
  const el = h(
    "form",
    {
      class: "filters",
      role: "search",
      onsubmit: (e) => {
        e.preventDefault();
        onChange();
      },
    },
    h("div", { class: "field" }, h("label", { for: "user-search" }, "Search user ids"), search),
    h("div", { class: "field" }, h("label", { for: "user-tier-filter" }, "Tier"), tier),
    h("div", { class: "field" }, h("label", { for: "user-sort" }, "Sort by"), sort),
  );
  let timer = null;
  search.addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(() => onChange(), TYPING_MS);
  });
  tier.addEventListener("change", () => onChange());
  sort.addEventListener("change", () => onChange());
  return {
    el,
    // The tier filter's choices, once (they come from the server).
    async fillTiers() {
      if (tier.options.length > 1) return;
      const { items } = await api("GET", "/tiers");
      for (const t of items) tier.append(h("option", { value: t.name }, t.name));
      tier.value = params.get("tier") || "";
    },
    query: () => ({ contains: search.value.trim(), tier: tier.value, sort: sort.value }),
  };
}

function pageButton(id, label, onclick) {
  return h("button", { type: "button", class: "secondary", id, onclick }, label);
}

// The "Configured users" section; refresh() reads the page shown again.
export function userList(params) {
  let page = Math.max(0, Number(params.get("page") || 0) | 0);
  const filters = filterForm(params, () => changed());
  const total = h("p", { id: "users-total", class: "hint", "aria-live": "polite" });
  const prev = pageButton("users-prev", "← Previous", () => {
    page -= 1;
    changed(false);
  });
  const next = pageButton("users-next", "Next →", () => {
    page += 1;
    changed(false);
  });
  const box = h("div");

  function changed(resetPage = true) {
    if (resetPage) page = 0;
    const { contains, tier, sort } = filters.query();
    replaceParams("users", null, {
      q: contains,
      tier,
      sort: sort === "user" ? "" : sort,
      page: page || "",
    });
    refresh();
  }

  async function refresh() {
    await filters.fillTiers();
    const { contains, tier, sort } = filters.query();
    const query = new URLSearchParams({
      limit: String(PAGE),
      offset: String(page * PAGE),
      sort,
    });
    if (contains) query.set("contains", contains);
    if (tier) query.set("tier", tier);
    const { items, total: count } = await api("GET", `/limits?${query}`);
    const first = page * PAGE;
    const shown = items.length
      ? ` (showing ${fmtInt(first + 1)}–${fmtInt(first + items.length)})`
      : "";
    total.textContent = `${plural(count, "configured user")}${shown}`;
    prev.disabled = page === 0;
    next.disabled = first + items.length >= count;
    box.replaceChildren(usersTable(items));
  }

  const el = section(
    "Configured users",
    filters.el,
    total,
    box,
    h("div", { class: "row" }, prev, next),
  );
  return { el, refresh };
}
