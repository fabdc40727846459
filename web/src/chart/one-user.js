// One user's chart: its tokens/s against its limit, and under it the latest values and
// the changes made to it (from the audit log, chart/changes.js) in words.

import { fmtInt, h, plural } from "../dom.js";
import { lastIndex, noSeries } from "./buckets.js";
import { changeEvents } from "./changes.js";
import { fmtLimit, fmtPct, fmtTok, hhmm, pct, Y_RATE } from "./format.js";
import { FIRST_COLOUR, LIMIT_COLOUR } from "./palette.js";
import { rateAxes } from "./scales.js";

// The user's limit in words, as set: "100 tok/s", or for an engine-scoped one "100 tok/s
// per engine (2 engines connected)" (each engine holds the user to the whole rate).
function limitWords(view, numEngines) {
  const limit = fmtLimit(view?.effective_output_tokens_per_second ?? null);
  if (view?.effective_scope !== "engine" || view.effective_output_tokens_per_second === null)
    return limit;
  return `${limit} per engine (${plural(numEngines, "engine")} connected)`;
}

// "Latest (14:05): 12.0 tok/s, 12% of its limit (100 tok/s)."; with a shadow limit, also
// what it would have throttled.
function latestLine(times, s, { shadow, limit }) {
  const rates = s.output_tokens_per_second;
  const i = lastIndex(rates);
  if (i < 0) return h("p", { id: "chart-latest" }, "No usage in this period.");
  const share =
    s.share_of_limit[i] === null
      ? "unlimited"
      : `${fmtPct(pct(s.share_of_limit[i]))} of the limit in force ` +
        `(${limit}${shadow ? ", shadow: not enforced" : ""})`;
  const would = shadow ? `; would throttle ${fmtPct(pct(s.would_throttle_fraction[i]))}` : "";
  return h(
    "p",
    { id: "chart-latest" },
    `Latest (${hhmm(times[i])}): ${fmtTok(rates[i])}, ${share}${would}.`,
  );
}

// The bucket each change falls in (-1: before the first).
const bucketOf = (times, at) => times.findLastIndex((t) => t <= at);

// The limit line: the bucket's limit where the user reported and no change fell in it (a
// bucket spanning a change would draw the average of two limits nobody set). Over the
// engines reporting an engine-scoped user, that is its per-engine limit once per engine.
function limitLine(s, changed) {
  return s.limit.map((l, i) =>
    s.output_tokens_per_second[i] === null || changed.has(i) ? null : l,
  );
}

// colour: the users' colours; view: its GET /limits view; audit: its audit entries;
// numEngines: the engines connected.
export function userChart(data, { user, colour, view, audit, numEngines, rangeLabel }) {
  const { times } = data;
  const s = data.items[0] || noSeries(times);
  const rates = s.output_tokens_per_second;
  const events = changeEvents(audit, data.since, data.until);
  const changed = new Set(events.map((e) => bucketOf(times, e.at)));
  const line = colour[user] || FIRST_COLOUR;
  const shadow = view?.effective_enforcement === "shadow";
  const limit = limitWords(view, numEngines);
  return {
    options: {
      series: [
        {},
        { label: `${user} tok/s`, stroke: line, width: 2, spanGaps: false },
        {
          label: `limit ${limit}`,
          stroke: LIMIT_COLOUR,
          dash: [6, 4],
          width: 1.5,
          spanGaps: false,
        },
      ],
      ...rateAxes(),
    },
    plotted: [times, rates, limitLine(s, changed)],
    marks: events.map((e) => ({ x: e.at, colour: LIMIT_COLOUR })),
    labels: [
      { series: 1, text: "tok/s", colour: line },
      { series: 2, text: "limit", colour: LIMIT_COLOUR },
    ],
    ariaLabel: `${user}: ${Y_RATE} against its limit (${limit}) over time, last ${rangeLabel}`,
    idle: lastIndex(rates) < 0,
    summary: [
      latestLine(times, s, { shadow, limit }),
      h(
        "p",
        { class: "hint" },
        `${fmtInt(s.tokens)} tokens granted, ${fmtInt(s.throttled)} throttled request-steps ` +
          "in this range. Gaps: no engine reported this user then.",
      ),
      ...events.map((e) =>
        h("p", { class: "hint chart-change" }, `Changed at ${hhmm(e.at)}: ${e.text}`),
      ),
    ],
  };
}
