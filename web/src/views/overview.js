// Overview: do all engines enforce the current version, fleet tokens/s, who is throttled.

import { api } from "../api.js";
import { historyChart } from "../chart.js";
import { fmtInt, fmtRateUnit, h, plural, section, table } from "../dom.js";
import { link, replaceParams } from "../router.js";

const TOP_LIVE = 10;

// Whether every connected engine applied the current version.
function enginesSummary(engines) {
  const connected = engines.items.filter((e) => e.connected);
  const behind = connected.filter((e) => e.applied_version < engines.version);
  return [
    h(
      "p",
      { class: `big ${behind.length ? "bad" : "good"}` },
      engines.items.length === 0
        ? "No engine has connected yet."
        : behind.length
          ? `${plural(behind.length, "engine")} of ${connected.length} connected ` +
            `not yet on version ${engines.version}`
          : `All ${plural(connected.length, "connected engine")} ` +
            `applied version ${engines.version}`,
    ),
    h(
      "p",
      { class: "hint" },
      `${plural(engines.items.length - connected.length, "engine")} disconnected. `,
      h("a", { href: link("engines") }, "Engine details"),
    ),
  ];
}

// The fleet's tokens/s over the last second and how many users are throttled.
function fleetNow(usage) {
  const total = usage.items.reduce((sum, u) => sum + u.output_tokens_per_second_1s, 0);
  const throttled = usage.items.filter((u) => u.throttled_fraction > 0);
  return [
    h("p", { class: "big", id: "fleet-rate" }, `${fmtInt(Math.round(total))} tok/s`),
    h(
      "p",
      { class: "hint" },
      `${plural(usage.items.length, "active user")}, ` +
        `${fmtInt(throttled.length)} throttled (last 10 s)`,
    ),
  ];
}

function throttledRow(u) {
  return h(
    "tr",
    { dataset: { user: u.user } },
    h("td", {}, h("a", { href: link("users", u.user) }, u.user)),
    h("td", {}, u.output_tokens_per_second_10s.toFixed(1)),
    h("td", {}, fmtRateUnit(u.limit)),
    h("td", {}, `${Math.round(u.throttled_fraction * 100)}%`),
    // Only a shadow limit counts would-throttles.
    h(
      "td",
      {},
      u.would_throttle_fraction > 0 ? `${(u.would_throttle_fraction * 100).toFixed(1)}%` : "–",
    ),
  );
}

// The TOP_LIVE most throttled users now (then the busiest).
function mostThrottled(usage) {
  const top = [...usage.items]
    .sort(
      (a, b) =>
        b.throttled_fraction - a.throttled_fraction ||
        b.output_tokens_per_second_10s - a.output_tokens_per_second_10s,
    )
    .slice(0, TOP_LIVE);
  if (!top.length) return h("p", { class: "hint" }, "No usage reported in the last 10 seconds.");
  return table(
    "most throttled users now",
    ["User", "tok/s (10 s)", "Limit", "Throttled", "Would throttle (shadow)"],
    top.map(throttledRow),
    { id: "live-usage" },
    { stack: true },
  );
}

export async function render(main, route) {
  const enginesBox = h("div", { id: "overview-engines" });
  const fleetBox = h("div", { id: "overview-fleet" });
  const throttledBox = h("div", { id: "overview-throttled" });
  const chart = historyChart({
    range: route.params.get("range") || "1h",
    onRange: (range) => replaceParams("overview", null, { range }),
  });
  main.replaceChildren(
    h("h2", { class: "view-title" }, "Overview"),
    h("div", { class: "grid" }, section("Engines", enginesBox), section("Fleet now", fleetBox)),
    section("Most throttled users now", throttledBox),
    section("History: share of limit", chart.el),
  );

  async function refreshLive() {
    const [engines, usage] = await Promise.all([api("GET", "/engines"), api("GET", "/usage")]);
    enginesBox.replaceChildren(...enginesSummary(engines));
    fleetBox.replaceChildren(...fleetNow(usage));
    throttledBox.replaceChildren(mostThrottled(usage));
  }

  await Promise.all([refreshLive(), chart.refresh()]);
  let ticks = 0;
  return {
    async refresh() {
      ticks += 1;
      await refreshLive();
      if (ticks % 6 === 0) await chart.refresh();
    },
    destroy: () => chart.destroy(),
    interval: 2000,
  };
}
