// The top users' legend: a table under the chart with each line's key (colour and dash),
// its user and its latest values, read without hovering (the plot's own legend is off).

import { h, table } from "../dom.js";
import { userLink } from "../router.js";
import { lastIndex } from "./buckets.js";
import { fmtLimit, fmtPct, fmtTok } from "./format.js";

const HEADERS = ["User", "Latest", "Limit in force", "Throttled", "Would throttle", ""];

// A legend key: the line's colour and dash pattern.
function swatch(colour, dash) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", "28");
  svg.setAttribute("height", "8");
  svg.setAttribute("aria-hidden", "true");
  svg.classList.add("dash");
  const line = document.createElementNS(ns, "line");
  for (const [k, v] of Object.entries({ x1: 0, y1: 4, x2: 28, y2: 4, stroke: colour })) {
    line.setAttribute(k, String(v));
  }
  line.setAttribute("stroke-width", "2.5");
  if (dash.length) line.setAttribute("stroke-dasharray", dash.join(" "));
  svg.append(line);
  return h(
    "span",
    { class: "legend-key" },
    h("span", { class: "swatch", style: `background:${colour}`, "aria-hidden": "true" }),
    svg,
  );
}

// Why a line is missing or partly missing from the plot.
function plotNote(series, i, drawn) {
  if (!drawn) return "unlimited: not plotted";
  const partly = i >= 0 && series.limited_fraction[i] !== null && series.limited_fraction[i] < 1;
  return partly ? "partly unlimited in the latest bucket" : "";
}

// One user's row. share: its drawn percentages; drawn: whether it has a line; shadow:
// its limit is in shadow, so "would throttle" is what the limit would have refused.
export function legendRow(series, { share, drawn, shadow, colour, dash }) {
  const i = lastIndex(share);
  const total = series.tokens + series.throttled;
  const would = total ? Math.min(1, series.would_throttle / total) : 0;
  return h(
    "tr",
    { dataset: { user: series.user, shadow: String(shadow) } },
    h(
      "td",
      {},
      swatch(colour, dash),
      userLink(series.user),
      shadow ? h("span", { class: "pill shadow" }, "shadow") : null,
    ),
    h(
      "td",
      { class: "latest", dataset: { share: String(i < 0 ? null : share[i]) } },
      i < 0 ? "–" : `${fmtPct(share[i])} (${fmtTok(series.output_tokens_per_second[i])})`,
    ),
    h("td", {}, fmtLimit(i < 0 ? null : series.limit[i])),
    h("td", {}, total ? `${Math.round((series.throttled / total) * 100)}%` : "0%"),
    h(
      "td",
      { class: "would" },
      shadow || series.would_throttle ? `${(would * 100).toFixed(1)}%` : "–",
    ),
    h("td", {}, plotNote(series, i, drawn)),
  );
}

export function legendTable(rows) {
  if (!rows.length) return h("p", { class: "hint" }, "No usage reported in this range.");
  return table(
    "users in the chart",
    HEADERS,
    rows,
    { class: "compact", id: "chart-legend" },
    { stack: true },
  );
}
