// Usage history charts (uPlot, from npm), drawn from GET /usage/history.
//  - fleet: the top N users (most throttled or busiest) as a share of the limit in force
//    (chart/top-users.js), and the fleet's total tokens/s (chart/fleet-total.js);
//  - one user: tokens/s against the limit in force (chart/one-user.js).
// Lines differ by colour and dash pattern (chart/palette.js) and are labelled at their
// ends (chart/labels.js); the text under the chart gives each line's latest value without
// hovering (chart/legend.js), and "Values per bucket" lists every drawn value
// (chart/values.js). Buckets with no report are gaps (an engine that disconnected), never
// zeros; limit changes are dashed vertical lines (chart/markers.js), on one user's chart
// the changes its audit log records (chart/changes.js). The current minute
// is over the seconds reported so far, not a dip.

import { fleetLatest, fleetTotalOptions } from "./chart/fleet-total.js";
import { loadHistory, RANGES, TOP_N } from "./chart/history.js";
import { endLabelPlugin, labelRoom } from "./chart/labels.js";
import { markerPlugin } from "./chart/markers.js";
import { userChart } from "./chart/one-user.js";
import { colours } from "./chart/palette.js";
import { plotIn } from "./chart/plot.js";
import { FLEET_HEIGHT, plotSize } from "./chart/scales.js";
import { topUsersChart } from "./chart/top-users.js";
import { valuesTable } from "./chart/values.js";
import { h } from "./dom.js";

// The range buttons; onPick(range) when one is pressed.
function rangeButtons(current, onPick) {
  const buttons = Object.entries(RANGES).map(([key, [, , label]]) =>
    h(
      "button",
      {
        type: "button",
        class: "secondary",
        "aria-pressed": String(key === current),
        dataset: { range: key },
        onclick: () => {
          for (const b of buttons) b.setAttribute("aria-pressed", String(b.dataset.range === key));
          onPick(key);
        },
      },
      label,
    ),
  );
  return buttons;
}

// Which users the fleet chart shows; onPick(order) when it changes.
function orderSelect(current, onPick) {
  const select = h(
    "select",
    { "aria-label": "which users", onchange: (e) => onPick(e.target.value) },
    h("option", { value: "throttled" }, `${TOP_N} most throttled users`),
    h("option", { value: "tokens" }, `${TOP_N} busiest users`),
  );
  select.value = current;
  return select;
}

// "Values per bucket (table)", filled when opened; show(data) refills it while open.
function valuesDetails(user) {
  const box = h("div", { class: "table-wrap" });
  let shown = null;
  const el = h(
    "details",
    {
      class: "chart-values",
      ontoggle: () => {
        if (el.open && shown) box.replaceChildren(valuesTable(shown, user));
      },
    },
    h("summary", {}, "Values per bucket (table)"),
    box,
  );
  return {
    el,
    show(data) {
      shown = data;
      if (el.open) box.replaceChildren(valuesTable(data, user));
    },
  };
}

// The fleet total's plot and its latest value, under the top users' chart.
function fleetTotal() {
  const box = h("div", {
    class: "fleet-chart",
    role: "img",
    "aria-label": "the fleet's output tokens/s over time",
  });
  const latest = h("p", { class: "hint", id: "fleet-history-latest" });
  const plot = plotIn(box, (b) => ({ ...plotSize(b), height: FLEET_HEIGHT }));
  return {
    el: h(
      "div",
      { class: "fleet-history" },
      h("h3", {}, "Fleet total: output tokens/s"),
      box,
      latest,
    ),
    plot,
    show(data) {
      plot.draw({ ...plot.size(), ...fleetTotalOptions() }, [
        data.times,
        data.fleet.output_tokens_per_second,
      ]);
      latest.textContent = fleetLatest(data);
    },
  };
}

// user: one user's chart, else the fleet's; onRange(range) when the operator picks one.
export function historyChart({
  user = null,
  range = "1h",
  order = "throttled",
  onRange = null,
} = {}) {
  const state = { range, order };
  const plotBox = h("div", { class: "chart", role: "img", "aria-label": "usage chart" });
  const plot = plotIn(plotBox, plotSize);
  const summary = h("div", { class: "chart-summary" });
  const values = valuesDetails(user);
  const fleet = user ? null : fleetTotal();
  const el = h(
    "div",
    { class: "history" },
    h(
      "div",
      { class: "row", role: "group", "aria-label": "time range" },
      h("span", { class: "hint" }, "Time range:"),
      rangeButtons(state.range, (key) => {
        state.range = key;
        if (onRange) onRange(key);
        refresh();
      }),
      user
        ? null
        : orderSelect(state.order, (value) => {
            state.order = value;
            refresh();
          }),
    ),
    plotBox,
    summary,
    values.el,
    fleet?.el,
  );
  // What the plugins draw at the next draw.
  let marks = [];
  let labels = [];
  let observer = null;

  // Both plots follow the width of the main one's box (the fleet total's is as wide).
  function followResizes() {
    observer = new ResizeObserver(() => {
      plot.resize();
      if (fleet) fleet.plot.resize();
    });
    observer.observe(plotBox);
  }

  function draw(chart) {
    marks = chart.marks;
    labels = chart.labels;
    const size = plot.size();
    plot.draw(
      {
        ...size,
        padding: [12, labelRoom(size.width, labels), 0, 0],
        ...chart.options,
        plugins: [markerPlugin(() => marks), endLabelPlugin(() => labels)],
      },
      chart.plotted,
    );
    if (!observer) followResizes();
    plotBox.setAttribute("aria-label", chart.ariaLabel);
  }

  async function refresh() {
    const { data, modes, views, audit, numEngines } = await loadHistory({ user, ...state });
    plotBox.dataset.points = String(data.times.length);
    const colour = colours(data.items.map((s) => s.user));
    const rangeLabel = RANGES[state.range][2];
    const chart = user
      ? userChart(data, { user, colour, view: views[user], audit, numEngines, rangeLabel })
      : topUsersChart(data, {
          colour,
          modes,
          ranked: state.order === "tokens" ? "busiest" : "most throttled",
          numUsers: TOP_N,
          rangeLabel,
        });
    // An idle user gets no empty axes: the summary says there was no usage.
    plotBox.hidden = Boolean(chart.idle);
    draw(chart);
    if (fleet) fleet.show(data);
    plotBox.dataset.series = String(plot.numSeries());
    values.show(data);
    summary.replaceChildren(...chart.summary);
  }

  return {
    el,
    refresh,
    destroy() {
      if (observer) observer.disconnect();
      plot.destroy();
      if (fleet) fleet.plot.destroy();
    },
  };
}
