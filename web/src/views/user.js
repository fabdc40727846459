// One user's page: the record, its scope and enforcement (with what a limit in shadow
// would have held back) and the shares engines hold of a fleet limit, a form that changes
// only what was changed (merge patch), removal with its effect stated, its API keys, the
// rate against the limit over time, its audit trail (with the bulk changes that touched
// it). The parts: user/facts.js, user/limit-form.js, user/shares.js, user/inherited.js.

import { api, request, userPath } from "../api.js";
import { apiKeysSection } from "../api-keys.js";
import { historyChart } from "../chart.js";
import { h, section } from "../dom.js";
import { link, replaceParams } from "../router.js";
import { canWrite } from "../session.js";
import { auditTable } from "./audit/audit-table.js";
import { limitSummary } from "./user/facts.js";
import { inheritance } from "./user/inherited.js";
import { limitForm } from "./user/limit-form.js";
import { sharesView } from "./user/shares.js";

// The history window the would-throttle fraction is read over (GET /usage/history).
const WOULD_THROTTLE_WINDOW_S = 3600;

// What the limit form shows: it is redrawn only when one of these changed (or on a save),
// so that a refresh keeps what the operator typed. The ETag is the record's version: a
// form kept while someone else saved the user still sends the one it was drawn with.
const formKey = (view, dflt, tiers) =>
  JSON.stringify([
    view.etag,
    view.tier,
    view.output_tokens_per_second,
    view.scope,
    view.enforcement,
    view.ceiling_output_tokens_per_second,
    view.configured,
    dflt.scope,
    dflt.enforcement,
    dflt.ceiling_output_tokens_per_second,
    tiers.map((t) => [
      t.name,
      t.output_tokens_per_second,
      t.scope,
      t.enforcement,
      t.ceiling_output_tokens_per_second,
    ]),
  ]);

// The user's view with the ETag of its record (what its writes send as If-Match).
export async function loadView(user) {
  const { data: view, etag } = await request("GET", userPath(user));
  view.etag = etag;
  return view;
}

// Everything the page shows but the chart and the keys, in one round of requests.
async function loadUser(user) {
  const since = new Date(Date.now() - WOULD_THROTTLE_WINDOW_S * 1000).toISOString();
  const [view, tiers, dflt, audit, list, history] = await Promise.all([
    loadView(user),
    api("GET", "/tiers"),
    api("GET", "/default-limit"),
    api("GET", `/audit?${new URLSearchParams({ target: user, limit: "50" })}`),
    api("GET", `/limits?${new URLSearchParams({ q: user, limit: "1" })}`),
    api("GET", `/usage/history?${new URLSearchParams({ user, since })}`),
  ]);
  // Configured: the first id at or after it, by prefix, is the user itself.
  view.configured = list.items.length > 0 && list.items[0].user === user;
  return { view, tiers: tiers.items, dflt, audit: audit.items, history };
}

export async function render(main, route) {
  const user = route.arg;
  const writer = canWrite();
  const summary = h("div", { id: "user-summary" });
  const formBox = h("div");
  const auditBox = h("div");
  // Bulk changes opened in the history, kept across refreshes.
  const openBulks = new Map();
  const sharesBox = h("div", { id: "user-shares" });
  const keys = apiKeysSection(user);
  const chart = historyChart({
    user,
    range: route.params.get("range") || "1h",
    onRange: (range) => replaceParams("users", user, { range }),
  });
  main.replaceChildren(
    h("p", {}, h("a", { href: link("users") }, "← All users")),
    h("h2", { class: "view-title" }, `User ${user}`),
    section("Limit", summary, formBox),
    section("API keys", keys.el),
    section("Fleet shares", sharesBox),
    section("Rate against the limit", chart.el),
    section(
      "Changes to this user",
      auditBox,
      h(
        "p",
        {},
        h(
          "a",
          { href: link("audit", null, { target: user }), id: "user-audit-link" },
          `All changes to ${user} in the audit log`,
        ),
      ),
    ),
  );

  let inherit = null;
  let shownForm = null;

  // force: redraw the form even if nothing it shows changed; edits: the fields to put
  // back into it over the values now (a save refused because someone else saved first).
  async function refresh(force = false, edits = null) {
    const [{ view, tiers, dflt, audit, history }] = await Promise.all([
      loadUser(user),
      keys.refresh(),
    ]);
    inherit = inheritance(tiers, dflt);
    summary.replaceChildren(...limitSummary(user, view, inherit, history));
    sharesBox.replaceChildren(sharesView(user, view));
    auditBox.replaceChildren(
      audit.length
        ? auditTable(audit, `changes to ${user}`, openBulks)
        : h("p", { class: "hint" }, "No changes recorded."),
    );
    const key = formKey(view, dflt, tiers);
    if (writer && (force || key !== shownForm)) {
      shownForm = key;
      formBox.replaceChildren(
        limitForm(user, view, { inherit, latest: () => inherit, refresh, loadView, edits }),
      );
    }
  }

  await Promise.all([refresh(true), chart.refresh()]);
  let ticks = 0;
  return {
    async refresh() {
      ticks += 1;
      await refresh();
      if (ticks % 3 === 0) await chart.refresh();
    },
    destroy() {
      chart.destroy();
      keys.destroy();
    },
    interval: 10000,
  };
}
