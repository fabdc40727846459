// The chart's size, axes and scales: time across; tokens/s or the share of the limit up,
// always from 0.

import { Y_RATE, Y_SHARE } from "./format.js";

// As wide as its box (at least 260 px), lower on a phone.
export function plotSize(box) {
  const width = Math.max(260, box.clientWidth || 600);
  return { width, height: width < 500 ? 220 : 280 };
}

// The fleet total's plot is lower: one line.
export const FLEET_HEIGHT = 160;

// Tokens/s, to a tenth above the highest value (at least 1 tok/s).
export const rateAxes = () => ({
  axes: [{}, { label: Y_RATE, size: 60 }],
  scales: {
    x: { time: true },
    y: { range: (_u, _min, max) => [0, Math.max(1, max * 1.1)] },
  },
});

// Percent of the limit, to the next 10 % above the highest value plus 10 and at least to
// 110 %: the limit itself (100 %) is always in view.
export const shareAxes = () => ({
  axes: [{}, { label: Y_SHARE, size: 60, values: (_u, vals) => vals.map((v) => `${v}%`) }],
  scales: {
    x: { time: true },
    y: {
      range: (_u, _min, max) => [0, Math.max(110, Math.ceil((max || 0) / 10) * 10 + 10)],
    },
  },
});
