// One user's page: the record, a form that changes only what was changed (merge patch),
// removal with its effect stated, the rate against the limit over time, its audit trail.

import { api, mergePatch, userPath } from "../api.js";
import { historyChart } from "../chart.js";
import { fmtRateUnit, h, section } from "../dom.js";
import { confirmEffect, handleSubmit, toast } from "../feedback.js";
import { rateField } from "../rate-field.js";
import { link, replaceParams } from "../router.js";
import { canWrite } from "../session.js";
import { auditTable } from "./audit.js";

const overrideWords = (rate) => (rate === null ? "none" : fmtRateUnit(rate));

export async function render(main, route) {
  const user = route.arg;
  const writer = canWrite();
  const summary = h("div", { id: "user-summary" });
  const formBox = h("div");
  const auditBox = h("div");
  const chart = historyChart({
    user,
    range: route.params.get("range") || "1h",
    onRange: (range) => replaceParams("users", user, { range }),
  });
  main.replaceChildren(
    h("p", {}, h("a", { href: link("users") }, "← All users")),
    h("h2", { class: "view-title" }, `User ${user}`),
    section("Limit", summary, formBox),
    section("Rate against the limit", chart.el),
    section("Changes to this user", auditBox),
  );

  let tiers = [];
  let defaultRate = null;
  let shown = null;

  const effective = (tier, override) =>
    override !== null
      ? override
      : tier !== null
        ? (tiers.find((t) => t.name === tier)?.output_tokens_per_second ?? null)
        : defaultRate;

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
    const el = h(
      "form",
      { id: "user-form", class: "stack" },
      h("div", { class: "field" }, h("label", { for: "user-tier" }, "Tier"), tier),
      override.el,
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
      if (newTier !== view.tier) changes.tier = newTier;
      if (newOverride !== view.output_tokens_per_second)
        changes.output_tokens_per_second = newOverride;
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
      const now = fmtRateUnit(result.effective_output_tokens_per_second);
      return `User ${user}: ${said.join(", ")}; now ${now}.`;
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
    const [view, tierList, def, audit, list] = await Promise.all([
      api("GET", userPath(user)),
      api("GET", "/tiers"),
      api("GET", "/default-limit"),
      api("GET", `/audit?${new URLSearchParams({ target: user, limit: "50" })}`),
      api("GET", `/limits?${new URLSearchParams({ q: user, limit: "1" })}`),
    ]);
    view.configured = list.items.length > 0 && list.items[0].user === user;
    tiers = tierList.items;
    defaultRate = def.output_tokens_per_second;
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
    auditBox.replaceChildren(
      audit.items.length
        ? auditTable(audit.items, `changes to ${user}`)
        : h("p", { class: "hint" }, "No changes recorded."),
    );
    const key = JSON.stringify([
      view.tier,
      view.output_tokens_per_second,
      view.configured,
      tiers.map((t) => [t.name, t.output_tokens_per_second]),
    ]);
    // The open form keeps what the operator typed unless the record changed.
    if (writer && (force || key !== shown)) {
      shown = key;
      formBox.replaceChildren(form(view));
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
    destroy: () => chart.destroy(),
    interval: 10000,
  };
}
