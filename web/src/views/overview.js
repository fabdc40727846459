// Overview: do all engines enforce the current version, fleet tokens/s, who is throttled.
// The headline is green only when every known engine is connected and on the current
// version; amber while connected ones lag behind it; red with an engine disconnected;
// grey and saying so while the control plane itself does not answer.

import { api } from "../api.js";
import { historyChart } from "../chart.js";
import { fmtInt, fmtRateUnit, h, plural, section, table } from "../dom.js";
import { link, replaceParams, userLink } from "../router.js";

const TOP_LIVE = 10;

// The headline: whether every engine is connected and applied the current version.
function headline(engines) {
  const total = engines.items.length;
  const connected = engines.items.filter((e) => e.connected);
  const dead = total - connected.length;
  const behind = connected.filter((e) => e.applied_version < engines.version);
  if (total === 0) return ["unknown", "No engine has connected yet."];
  const lagging = behind.length
    ? `${plural(behind.length, "engine")} not yet on version ${engines.version}`
    : null;
  if (dead)
    return [
      "bad",
      `${plural(dead, "engine")} of ${total} disconnected${lagging ? `; ${lagging}` : ""}`,
    ];
  if (lagging) return ["warn", `${lagging} (of ${total})`];
  return ["good", `All ${plural(total, "engine")} connected and on version ${engines.version}`];
}

// Said instead of the headline while the control plane does not answer.
const UNREACHABLE =
  "Control plane unreachable: whether engines applied the latest version is unknown";

function enginesSummary(engines) {
  const connected = engines.items.filter((e) => e.connected);
  const [kind, words] = headline(engines);
  return [
    h("p", { class: `big ${kind}`, id: "engines-headline", dataset: { state: kind } }, words),
    h(
      "p",
      { class: "hint" },
      `${plural(engines.items.length - connected.length, "engine")} disconnected. `,
      h("a", { href: link("engines") }, "Engine details"),
    ),
  ];
}

// The fleet's tokens/s over the last second (and of them, those borrowed beyond the
// users' limits) and how many users are throttled.
function fleetNow(usage) {
  const sum = (field) => usage.items.reduce((total, u) => total + u[field], 0);
  const total = sum("output_tokens_per_second_1s");
  const borrowed = sum("borrowed_output_tokens_per_second_1s");
  const throttled = usage.items.filter((u) => u.throttled_fraction > 0);
  return [
    h("p", { class: "big", id: "fleet-rate" }, `${fmtInt(Math.round(total))} tok/s`),
    h(
      "p",
      { class: "hint", id: "fleet-borrowed" },
      borrowed > 0
        ? `${fmtInt(Math.round(borrowed))} tok/s of it borrowed idle capacity (beyond limits)`
        : "None borrowed beyond limits.",
    ),
    h(
      "p",
      { class: "hint" },
      `${plural(usage.items.length, "active user")}, ` +
        `${fmtInt(throttled.length)} throttled (last 10 s)`,
    ),
  ];
}

// A limit and the ceiling a user may borrow up to above it.
function limitWords(u) {
  const limit = fmtRateUnit(u.limit);
  return u.ceiling === null || u.ceiling === undefined
    ? limit
    : `${limit}, ceiling ${fmtRateUnit(u.ceiling)}`;
}

function throttledRow(u) {
  const borrowed = u.borrowed_output_tokens_per_second_10s;
  const total = u.output_tokens_per_second_10s;
  return h(
    "tr",
    { dataset: { user: u.user } },
    h("td", {}, userLink(u.user)),
    // Within the limit and borrowed beyond it, side by side: together the user's tok/s.
    h("td", { class: "within-limit" }, Math.max(0, total - borrowed).toFixed(1)),
    h("td", { class: "borrowed" }, borrowed > 0 ? borrowed.toFixed(1) : "–"),
    h("td", {}, limitWords(u)),
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
    [
      "User",
      "Within limit tok/s (10 s)",
      "Borrowed tok/s (10 s)",
      "Limit",
      "Throttled",
      "Would throttle (shadow)",
    ],
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

  function unreachable() {
    const line = enginesBox.querySelector("#engines-headline");
    if (!line) return;
    line.className = "big unknown";
    line.dataset.state = "unreachable";
    line.textContent = UNREACHABLE;
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
    // Down: the headline says so (the shell greys the rest); back: the next refresh
    // redraws it from the engines' state.
    onConnection: (down) => down && unreachable(),
    interval: 2000,
  };
}
