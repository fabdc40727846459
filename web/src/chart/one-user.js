// One user's chart: its tokens/s against the limit in force, and under it the latest
// values and the limit changes in words.

import { fmtInt, h } from "../dom.js";
import { lastIndex, limitChanges, noSeries } from "./buckets.js";
import { fmtLimit, fmtPct, fmtTok, hhmm, pct, Y_RATE } from "./format.js";
import { FIRST_COLOUR, LIMIT_COLOUR } from "./palette.js";
import { rateAxes } from "./scales.js";

// "Latest (14:05): 12.0 tok/s, 12% of the limit in force (100 tok/s)."; with a shadow
// limit, also what it would have throttled.
function latestLine(times, s, shadow) {
  const rates = s.output_tokens_per_second;
  const i = lastIndex(rates);
  if (i < 0) return h("p", { id: "chart-latest" }, "No usage reported in this range.");
  const share =
    s.share_of_limit[i] === null
      ? "unlimited"
      : `${fmtPct(pct(s.share_of_limit[i]))} of the limit in force ` +
        `(${fmtLimit(s.limit[i])}${shadow ? ", shadow: not enforced" : ""})`;
  const would = shadow ? `; would throttle ${fmtPct(pct(s.would_throttle_fraction[i]))}` : "";
  return h(
    "p",
    { id: "chart-latest" },
    `Latest (${hhmm(times[i])}): ${fmtTok(rates[i])}, ${share}${would}.`,
  );
}

// colour: the users' colours; shadow: the user's limit is in shadow.
export function userChart(data, { user, colour, shadow, rangeLabel }) {
  const { times } = data;
  const s = data.items[0] || noSeries(times);
  const rates = s.output_tokens_per_second;
  const changes = limitChanges(rates, s.limit);
  const line = colour[user] || FIRST_COLOUR;
  return {
    options: {
      series: [
        {},
        { label: `${user} tok/s`, stroke: line, width: 2, spanGaps: false },
        {
          label: "limit in force",
          stroke: LIMIT_COLOUR,
          dash: [6, 4],
          width: 1.5,
          spanGaps: false,
        },
      ],
      ...rateAxes(),
    },
    // The limit is drawn only where the user reported: its gaps are the rate's.
    plotted: [times, rates, s.limit.map((l, i) => (rates[i] === null ? null : l))],
    marks: changes.map((m) => ({ x: times[m.i], colour: LIMIT_COLOUR })),
    labels: [
      { series: 1, text: "tok/s", colour: line },
      { series: 2, text: "limit", colour: LIMIT_COLOUR },
    ],
    ariaLabel: `${user}: ${Y_RATE} against the limit in force over time, last ${rangeLabel}`,
    summary: [
      latestLine(times, s, shadow),
      h(
        "p",
        { class: "hint" },
        `${fmtInt(s.tokens)} tokens granted, ${fmtInt(s.throttled)} throttled request-steps ` +
          "in this range. Gaps: no engine reported this user then.",
      ),
      ...changes.map((m) =>
        h(
          "p",
          { class: "hint" },
          `Limit changed at ${hhmm(times[m.i])}: ${fmtLimit(m.from)} → ${fmtLimit(m.to)}`,
        ),
      ),
    ],
  };
}
