// One user's page: the record, its scope and enforcement (with what a limit in shadow
// would have held back) and the shares engines hold of a fleet limit, a
// form that changes only what was changed (merge patch), removal with its effect stated,
// its API keys, the rate against the limit over time, its audit trail (with the bulk
// changes that touched it).

import { api, mergePatch, userPath } from "../api.js";
import { apiKeysSection } from "../api-keys.js";
import { historyChart } from "../chart.js";
import { fmtRateUnit, h, section, table } from "../dom.js";
import { confirmEffect, handleSubmit, toast } from "../feedback.js";
import { rateField } from "../rate-field.js";
import { link, replaceParams } from "../router.js";
import { enforcementField, enforcementWords, scopeField, scopeWords } from "../scope-field.js";
import { canWrite } from "../session.js";
import { auditTable } from "./audit.js";

const overrideWords = (rate) => (rate === null ? "none" : fmtRateUnit(rate));
const fmtTokens = (rate) => `${rate.toFixed(1)} tok/s`;
// The history window the would-throttle fraction is read over (GET /usage/history).
const WOULD_THROTTLE_WINDOW_S = 3600;

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

  let tiers = [];
  let defaultRate = null;
  let defaultScope = null;
  let defaultEnforcement = null;
  let shown = null;

  const effective = (tier, override) =>
    override !== null
      ? override
      : tier !== null
        ? (tiers.find((t) => t.name === tier)?.output_tokens_per_second ?? null)
        : defaultRate;

  // Where an inherited scope comes from: the user's tier if it sets one, else the default.
  const inheritedFrom = (tierName) => {
    const tierScope = tiers.find((t) => t.name === tierName)?.scope ?? null;
    return tierScope !== null
      ? `tier ${tierName}: ${tierScope}`
      : `the default: ${scopeWords(defaultScope, "fleet")}`;
  };

  // Where an inherited enforcement comes from, likewise.
  const enforcementFrom = (tierName) => {
    const own = tiers.find((t) => t.name === tierName)?.enforcement ?? null;
    return own !== null
      ? `tier ${tierName}: ${own}`
      : `the default: ${enforcementWords(defaultEnforcement, "enforce")}`;
  };

  function form(view) {
    const tier = h(
      "select",
      { id: "user-tier", "data-field": "tier" },
      h("option", { value: "" }, "(no tier: the default applies)"),
      tiers.map((t) =>
        h("option", { value: t.name }, `${t.name} (${fmtRateUnit(t.output_tokens_per_second)})`),
      ),
    );
    tier.value = view.tier || "";
    const override = rateField({
      id: "user-override",
      legend: "Own override",
      value: view.output_tokens_per_second,
      noneLabel: "No override (the tier's or the default rate)",
    });
    const scope = scopeField({
      id: "user-scope",
      value: view.scope,
      inheritLabel: `Inherit (${inheritedFrom(view.tier)})`,
    });
    const enforcement = enforcementField({
      id: "user-enforcement",
      value: view.enforcement,
      inheritLabel: `Inherit (${enforcementFrom(view.tier)})`,
    });
    const el = h(
      "form",
      { id: "user-form", class: "stack" },
      h("div", { class: "field" }, h("label", { for: "user-tier" }, "Tier"), tier),
      override.el,
      scope.el,
      enforcement.el,
      h(
        "div",
        { class: "row" },
        h("button", { type: "submit" }, `Save user ${user}`),
        view.configured
          ? h(
              "button",
              {
                type: "button",
                class: "danger",
                "aria-label": `Remove user ${user}`,
                onclick: () => remove(view),
              },
              "Remove tier and override",
            )
          : null,
      ),
    );
    handleSubmit(el, async () => {
      const changes = {};
      const newTier = tier.value || null;
      const newOverride = override.value();
      const newScope = scope.value();
      if (newTier !== view.tier) changes.tier = newTier;
      if (newOverride !== view.output_tokens_per_second)
        changes.output_tokens_per_second = newOverride;
      if (newScope !== view.scope) changes.scope = newScope;
      const newEnforcement = enforcement.value();
      if (newEnforcement !== view.enforcement) changes.enforcement = newEnforcement;
      if (!Object.keys(changes).length) return `User ${user}: nothing changed.`;
      const before = view.effective_output_tokens_per_second;
      const after = effective(newTier, newOverride);
      if (after === null && before !== null) {
        const ok = await confirmEffect(
          `Remove the limit of ${user}?`,
          [`${user}: ${fmtRateUnit(before)} → unlimited`],
          `Make ${user} unlimited`,
        );
        if (!ok) return "Not changed.";
      }
      const result = await mergePatch(userPath(user), changes);
      await refresh(true);
      const said = [];
      if ("tier" in changes) said.push(`tier ${view.tier || "none"} → ${result.tier || "none"}`);
      if ("output_tokens_per_second" in changes)
        said.push(
          `override ${overrideWords(view.output_tokens_per_second)} → ` +
            overrideWords(result.output_tokens_per_second),
        );
      if ("scope" in changes)
        said.push(`scope ${scopeWords(view.scope)} → ${scopeWords(result.scope)}`);
      if ("enforcement" in changes)
        said.push(
          `enforcement ${enforcementWords(view.enforcement)} → ` +
            enforcementWords(result.enforcement),
        );
      const now = fmtRateUnit(result.effective_output_tokens_per_second);
      return `User ${user}: ${said.join(", ")}; now ${now} (${result.effective_scope} scope).`;
    });
    return el;
  }

  async function remove(view) {
    const parts = [
      view.tier ? `tier ${view.tier}` : null,
      view.output_tokens_per_second !== null
        ? `override ${fmtRateUnit(view.output_tokens_per_second)}`
        : null,
    ].filter(Boolean);
    const ok = await confirmEffect(
      `Remove ${user}'s tier and override?`,
      [
        `${user}: ${parts.join(" and ") || "its record"} removed.`,
        `${user} then gets the default limit: ` +
          `${fmtRateUnit(view.effective_output_tokens_per_second)} → ${fmtRateUnit(defaultRate)}.`,
      ],
      `Remove ${user}`,
    );
    if (!ok) return;
    try {
      await api("DELETE", userPath(user));
      toast(`User ${user} removed: the default limit (${fmtRateUnit(defaultRate)}) applies.`);
      await refresh(true);
    } catch (error) {
      toast(error.message, "error");
    }
  }

  async function refresh(force = false) {
    const since = new Date(Date.now() - WOULD_THROTTLE_WINDOW_S * 1000).toISOString();
    const [view, tierList, def, audit, list, history] = await Promise.all([
      api("GET", userPath(user)),
      api("GET", "/tiers"),
      api("GET", "/default-limit"),
      api("GET", `/audit?${new URLSearchParams({ target: user, limit: "50" })}`),
      api("GET", `/limits?${new URLSearchParams({ q: user, limit: "1" })}`),
      api("GET", `/usage/history?${new URLSearchParams({ user, since })}`),
      keys.refresh(),
    ]);
    view.configured = list.items.length > 0 && list.items[0].user === user;
    tiers = tierList.items;
    defaultRate = def.output_tokens_per_second;
    defaultScope = def.scope;
    defaultEnforcement = def.enforcement;
    // Over the window: of the user's request-steps, those a shadow limit would have refused.
    const series = history.items[0];
    const numSteps = series ? series.tokens + series.throttled : 0;
    const wouldThrottle = numSteps ? Math.min(1, series.would_throttle / numSteps) : null;
    summary.replaceChildren(
      ...[
        h(
          "dl",
          { class: "facts" },
          h("dt", {}, "Effective"),
          h(
            "dd",
            { id: "user-effective" },
            `${fmtRateUnit(view.effective_output_tokens_per_second)} (from the ${view.source})`,
          ),
          h("dt", {}, "Tier"),
          h("dd", {}, view.tier || "none"),
          h("dt", {}, "Override"),
          h(
            "dd",
            {},
            view.output_tokens_per_second === null
              ? "none"
              : fmtRateUnit(view.output_tokens_per_second),
          ),
          h("dt", {}, "Scope"),
          h(
            "dd",
            { id: "user-scope-effective" },
            view.scope === null
              ? `${view.effective_scope} (inherited from ${inheritedFrom(view.tier)})`
              : `${view.effective_scope} (its own)`,
          ),
          h("dt", {}, "Enforcement"),
          h(
            "dd",
            { id: "user-enforcement-effective" },
            (view.effective_enforcement === "shadow"
              ? "shadow: counted, not enforced"
              : view.effective_enforcement) +
              (view.enforcement === null
                ? ` (inherited from ${enforcementFrom(view.tier)})`
                : " (its own)"),
          ),
          h("dt", {}, "Would be throttled"),
          h(
            "dd",
            { id: "user-would-throttle" },
            wouldThrottle === null
              ? "no usage reported in the last hour"
              : `${(wouldThrottle * 100).toFixed(1)}% of its request-steps in the last hour` +
                  (view.effective_enforcement === "shadow" ? "" : " (while in shadow)"),
          ),
          h("dt", {}, "Received now"),
          h(
            "dd",
            { id: "user-received" },
            view.received_output_tokens_per_second === null
              ? "no engine reports it"
              : `${fmtTokens(view.received_output_tokens_per_second)} (all engines, last second)`,
          ),
        ),
        view.configured
          ? null
          : h(
              "p",
              { class: "notice" },
              `${user} is not configured: it gets the default limit. Saving below creates it.`,
            ),
      ].filter(Boolean),
    );
    sharesBox.replaceChildren(sharesView(view));
    auditBox.replaceChildren(
      audit.items.length
        ? auditTable(audit.items, `changes to ${user}`, openBulks)
        : h("p", { class: "hint" }, "No changes recorded."),
    );
    const key = JSON.stringify([
      view.tier,
      view.output_tokens_per_second,
      view.scope,
      view.enforcement,
      view.configured,
      defaultScope,
      defaultEnforcement,
      tiers.map((t) => [t.name, t.output_tokens_per_second, t.scope, t.enforcement]),
    ]);
    // The open form keeps what the operator typed unless the record changed.
    if (writer && (force || key !== shown)) {
      shown = key;
      formBox.replaceChildren(form(view));
    }
  }
  function sharesView(view) {
    if (view.effective_output_tokens_per_second === null)
      return h("p", { class: "hint" }, "Unlimited: no engine holds a share.");
    if (view.effective_scope === "engine")
      return h("p", { class: "hint" }, "Engine scope: each engine enforces the full limit.");
    if (!view.shares.length)
      return h(
        "p",
        { class: "hint" },
        "No engine holds a share now: engines serving the user start on an even part of the limit.",
      );
    return table(
      `shares of ${user}'s limit per engine`,
      ["Engine", "Share"],
      view.shares.map((share) =>
        h(
          "tr",
          { dataset: { engine: share.engine_id } },
          h("td", {}, share.engine_id),
          h("td", {}, fmtTokens(share.output_tokens_per_second)),
        ),
      ),
      { id: "user-shares-table" },
    );
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
