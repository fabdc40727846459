// The top users' chart: each one's share of the limit in force (the server weighs a
// bucket spanning a limit change by time, never dividing by the new limit), with a
// legend table of their latest values.

import { h } from "../dom.js";
import { limitChanges } from "./buckets.js";
import { pct, Y_SHARE } from "./format.js";
import { legendRow, legendTable } from "./legend.js";
import { dashes } from "./palette.js";
import { shareAxes } from "./scales.js";

const HINT =
  "Share of the limit in force during each part of each bucket (a limit change " +
  "within a bucket is weighed by time). Gaps: no engine reported the user then " +
  "(e.g. an engine disconnected). Vertical dashed lines: limit changes.";

// colour: the users' colours; modes: user -> its enforcement; ranked: how they were
// picked ("most throttled", "busiest").
export function topUsersChart(data, { colour, modes, ranked, numUsers, rangeLabel }) {
  const { times, items } = data;
  const dash = dashes(items.map((s) => s.user));
  const series = [{}];
  const plotted = [times];
  const marks = [];
  const labels = [];
  const rows = [];
  for (const s of items) {
    const share = s.share_of_limit.map(pct);
    // An unlimited user has no share: it is listed, not plotted.
    const drawn = share.some((v) => v !== null);
    const shadow = modes[s.user] === "shadow";
    for (const m of limitChanges(s.output_tokens_per_second, s.limit))
      marks.push({ x: times[m.i], colour: colour[s.user] });
    if (drawn) {
      series.push({
        label: s.user,
        stroke: colour[s.user],
        dash: dash[s.user],
        width: 2,
        spanGaps: false,
        points: { show: false },
        value: (_u, v) => (v == null ? "–" : `${v}%`),
      });
      plotted.push(share);
      labels.push({
        series: series.length - 1,
        text: shadow ? `${s.user} (shadow)` : s.user,
        colour: colour[s.user],
      });
    }
    rows.push(legendRow(s, { share, drawn, shadow, colour: colour[s.user], dash: dash[s.user] }));
  }
  return {
    // The table under the chart is the legend, with values.
    options: { series, legend: { show: false }, ...shareAxes() },
    plotted,
    marks,
    labels,
    ariaLabel: `${Y_SHARE} of the ${numUsers} ${ranked} users over time, last ${rangeLabel}`,
    summary: [h("p", { class: "hint" }, HINT), legendTable(rows)],
  };
}
