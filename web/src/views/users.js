// Users: substring search, tier filter, sorting, pages; each row opens the user's page.
// Opening an id nobody configured asks before it is created; a bulk import is previewed by
// the server (one POST ?dry_run=true with the CSV as written) and confirmed first.

import { api, userPath } from "../api.js";
import { fmtInt, fmtRateUnit, h, plural, section, table } from "../dom.js";
import { confirmEffect, FieldError, handleSubmit } from "../feedback.js";
import { impactLines } from "../preview.js";
import { link, replaceParams } from "../router.js";
import { canWrite } from "../session.js";

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

// Whether `user` is configured (has a row): the first id at or after it, by prefix.
export async function isConfigured(user) {
  const { items } = await api("GET", `/limits?${new URLSearchParams({ q: user, limit: "1" })}`);
  return items.length > 0 && items[0].user === user;
}

export async function openUser(user) {
  if (await isConfigured(user)) {
    location.hash = link("users", user);
    return true;
  }
  const ok = await confirmEffect(
    `User ${user} is not configured`,
    [
      `No user with the id “${user}” exists yet (check the spelling).`,
      "Continue to set a tier or an override for it; nothing is created until you save.",
    ],
    `Continue with ${user}`,
  );
  if (ok) location.hash = link("users", user, { new: "1" });
  return ok;
}

export async function render(main, route) {
  const writer = canWrite();
  const p = route.params;
  const search = h("input", {
    id: "user-search",
    type: "search",
    value: p.get("q") || "",
    autocomplete: "off",
  });
  const tierFilter = h(
    "select",
    { id: "user-tier-filter" },
    h("option", { value: "" }, "All tiers"),
  );
  const sort = h(
    "select",
    { id: "user-sort" },
    Object.entries(SORTS).map(([v, t]) => h("option", { value: v }, t)),
  );
  sort.value = p.get("sort") || "user";
  let page = Math.max(0, Number(p.get("page") || 0) | 0);
  const total = h("p", { id: "users-total", class: "hint", "aria-live": "polite" });
  const prev = h(
    "button",
    {
      type: "button",
      class: "secondary",
      id: "users-prev",
      onclick: () => {
        page -= 1;
        changed(false);
      },
    },
    "← Previous",
  );
  const next = h(
    "button",
    {
      type: "button",
      class: "secondary",
      id: "users-next",
      onclick: () => {
        page += 1;
        changed(false);
      },
    },
    "Next →",
  );
  const box = h("div");
  const filters = h(
    "form",
    {
      class: "filters",
      role: "search",
      onsubmit: (e) => {
        e.preventDefault();
        changed();
      },
    },
    h("div", { class: "field" }, h("label", { for: "user-search" }, "Search user ids"), search),
    h("div", { class: "field" }, h("label", { for: "user-tier-filter" }, "Tier"), tierFilter),
    h("div", { class: "field" }, h("label", { for: "user-sort" }, "Sort by"), sort),
  );
  let timer = null;
  search.addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(() => changed(), 250);
  });
  tierFilter.addEventListener("change", () => changed());
  sort.addEventListener("change", () => changed());

  main.replaceChildren(
    h("h2", { class: "view-title" }, "Users"),
    section(writer ? "Find or add a user" : "Find a user", findForm()),
    section("Configured users", filters, total, box, h("div", { class: "row" }, prev, next)),
  );
  if (writer) main.append(section("Bulk import", bulkForm()));

  function findForm() {
    const id = h("input", {
      id: "open-user",
      autocomplete: "off",
      "data-field": "user",
      maxlength: 256,
    });
    const form = h(
      "form",
      { id: "open-user-form", class: "row", role: "search" },
      h("label", { for: "open-user" }, "User id"),
      id,
      h("button", { type: "submit" }, "Open user"),
    );
    handleSubmit(form, async () => {
      const user = id.value.trim();
      if (!user)
        throw new FieldError(
          "user",
          "User id: enter the id your clients send as output_rate_user.",
        );
      // biome-ignore lint/suspicious/noControlCharactersInRegex: finding them is the check.
      if (/[\x00-\x1f\x7f]/.test(user))
        throw new FieldError("user", "User id: control characters are not allowed.");
      // A viewer only looks: an unconfigured id shows the default that applies to it.
      if (writer) await openUser(user);
      else location.hash = link("users", user);
      return null;
    });
    return form;
  }

  function bulkForm() {
    const text = h("textarea", {
      id: "bulk-text",
      rows: 5,
      "data-field": "items",
      placeholder: 'user,tier,override,scope,enforcement\nalice,pro\n"bob, inc",,50,engine,shadow',
    });
    const form = h(
      "form",
      { id: "bulk-form", class: "stack" },
      h(
        "p",
        { class: "hint" },
        "One user per line, 5 columns: user id, tier, override tok/s, scope (fleet or " +
          "engine), enforcement (enforce or shadow). Each line replaces that user's record: " +
          "an empty column clears it (no scope or enforcement: the tier's or the default's). " +
          'Quote a field that holds a comma ("acme, inc"); an optional first line of ' +
          "column names is skipped. The server checks every line and shows whom the " +
          "import holds back before anything is written.",
      ),
      h("div", { class: "field" }, h("label", { for: "bulk-text" }, "Lines (CSV)"), text),
      h("button", { type: "submit" }, "Preview and import"),
    );
    const csv = { contentType: "text/csv" };
    handleSubmit(form, async () => {
      const body = text.value;
      if (!body.trim()) throw new FieldError("items", "Lines: enter at least one line.");
      let preview;
      let dflt;
      try {
        [preview, dflt] = await Promise.all([
          api("POST", "/limits:bulk?dry_run=true", body, csv),
          api("GET", "/default-limit"),
        ]);
      } catch (error) {
        // Bad lines, each with its line number, stay in the form: nothing was written.
        throw new FieldError("items", error.message);
      }
      const n = preview.num_users;
      const kept = preview.num_records_unchanged;
      const replaced = n - preview.num_created - kept;
      const ok = await confirmEffect(
        `Import ${plural(n, "user")}?`,
        [
          replaced
            ? `${plural(replaced, "existing user")}: ` +
              `${replaced === 1 ? "its record is" : "their records are"} replaced.`
            : null,
          kept ? `${plural(kept, "line")} equal to the stored record: nothing changes.` : null,
          ...impactLines(preview, { before: dflt, after: dflt }),
        ].filter(Boolean),
        `Import ${plural(n, "user")}`,
      );
      if (!ok) return "Not imported.";
      const result = await api("POST", "/limits:bulk", body, csv);
      text.value = "";
      await refresh();
      return `Imported: ${plural(result.num_changed, "user")} changed (version ${result.version}).`;
    });
    return form;
  }

  function changed(resetPage = true) {
    if (resetPage) page = 0;
    replaceParams("users", null, {
      q: search.value.trim(),
      tier: tierFilter.value,
      sort: sort.value === "user" ? "" : sort.value,
      page: page || "",
    });
    refresh();
  }

  async function refresh() {
    if (tierFilter.options.length === 1) {
      const { items } = await api("GET", "/tiers");
      for (const t of items) tierFilter.append(h("option", { value: t.name }, t.name));
      tierFilter.value = p.get("tier") || "";
    }
    const params = new URLSearchParams({
      limit: String(PAGE),
      offset: String(page * PAGE),
      sort: sort.value,
    });
    if (search.value.trim()) params.set("contains", search.value.trim());
    if (tierFilter.value) params.set("tier", tierFilter.value);
    const { items, total: count } = await api("GET", `/limits?${params}`);
    const first = page * PAGE;
    const shown = items.length
      ? ` (showing ${fmtInt(first + 1)}–${fmtInt(first + items.length)})`
      : "";
    total.textContent = `${plural(count, "configured user")}${shown}`;
    prev.disabled = page === 0;
    next.disabled = first + items.length >= count;
    box.replaceChildren(
      items.length
        ? table(
            "configured users",
            ["User", "Tier", "Override", "Effective", "From", "Scope"],
            items.map((u) =>
              h(
                "tr",
                { dataset: { user: u.user } },
                h(
                  "td",
                  {},
                  h(
                    "a",
                    { href: link("users", u.user), "aria-label": `Open user ${u.user}` },
                    u.user,
                  ),
                ),
                h("td", {}, u.tier || "–"),
                h(
                  "td",
                  {},
                  u.output_tokens_per_second === null
                    ? "–"
                    : fmtRateUnit(u.output_tokens_per_second),
                ),
                h(
                  "td",
                  {},
                  fmtRateUnit(u.effective_output_tokens_per_second) +
                    (u.effective_enforcement === "shadow" &&
                    u.effective_output_tokens_per_second !== null
                      ? " (shadow)"
                      : ""),
                ),
                h("td", {}, u.source),
                h(
                  "td",
                  {},
                  u.scope === null ? `${u.effective_scope} (inherited)` : u.effective_scope,
                ),
              ),
            ),
            { id: "users" },
            { stack: true },
          )
        : h("p", { class: "hint" }, "No configured user matches."),
    );
  }
  await refresh();
  return { refresh, interval: 10000 };
}

export { userPath };
