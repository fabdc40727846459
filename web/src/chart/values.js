// "Values per bucket": every drawn value in a table, so the lines read without the canvas.

import { h } from "../dom.js";
import { fmtLimit, fmtPct, fmtTok, pct, stamp } from "./format.js";

// One user's buckets with a report: its rate, the limit in force and its share of it.
function userRows({ times, step, items }) {
  const s = items[0];
  if (!s) return [];
  return times.flatMap((t, i) =>
    s.output_tokens_per_second[i] === null
      ? []
      : [
          h(
            "tr",
            { dataset: { time: String(t) } },
            h("td", {}, stamp(t, step)),
            h("td", {}, fmtTok(s.output_tokens_per_second[i])),
            h("td", {}, fmtLimit(s.limit[i])),
            h(
              "td",
              { dataset: { share: String(pct(s.share_of_limit[i])) } },
              fmtPct(pct(s.share_of_limit[i])),
            ),
            h("td", {}, fmtPct(pct(s.would_throttle_fraction[i]))),
          ),
        ],
  );
}

// The top users' buckets with any report: each drawn user's share, and the fleet total.
function topRows({ times, step, fleet }, shown) {
  return times.flatMap((t, i) => {
    const total = fleet.output_tokens_per_second[i];
    if (total === null && shown.every((s) => s.share_of_limit[i] === null)) return [];
    return [
      h(
        "tr",
        { dataset: { time: String(t) } },
        h("td", {}, stamp(t, step)),
        shown.map((s) =>
          h(
            "td",
            { dataset: { user: s.user, share: String(pct(s.share_of_limit[i])) } },
            fmtPct(pct(s.share_of_limit[i])),
          ),
        ),
        h("td", { dataset: { fleet: String(total) } }, fmtTok(total)),
      ),
    ];
  });
}

// user: the one user's chart, or null for the top users'.
export function valuesTable(data, user) {
  const shown = data.items.filter((s) => s.share_of_limit.some((v) => v !== null));
  const headers = user
    ? ["Bucket", "tok/s", "Limit in force", "% of limit", "Would throttle"]
    : ["Bucket", ...shown.map((s) => s.user), "Fleet tok/s"];
  return h(
    "table",
    { class: "compact", id: "chart-values" },
    h("caption", { class: "visually-hidden" }, "chart values per bucket"),
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        headers.map((t) => h("th", { scope: "col" }, t)),
      ),
    ),
    h("tbody", {}, user ? userRows(data) : topRows(data, shown)),
  );
}
