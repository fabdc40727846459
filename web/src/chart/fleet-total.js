// The fleet's total output tokens/s under the top users' chart, and its latest value.

import { fmtInt } from "../dom.js";
import { lastIndex } from "./buckets.js";
import { fmtTok, hhmm } from "./format.js";
import { rateAxes } from "./scales.js";

export const fleetTotalOptions = () => ({
  legend: { show: false }, // the latest value is written under it
  series: [
    {},
    { label: "fleet tok/s", stroke: "#1d2330", width: 2, spanGaps: false, points: { show: false } },
  ],
  ...rateAxes(),
});

export function fleetLatest({ times, fleet }) {
  const rates = fleet.output_tokens_per_second;
  const i = lastIndex(rates);
  return i < 0
    ? "No usage reported in this range."
    : `Latest (${hhmm(times[i])}): ${fmtTok(rates[i])}; ` +
        `${fmtInt(fleet.tokens)} tokens in this range.`;
}
