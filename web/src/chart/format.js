// The chart's values and times as words.

import { fmtInt } from "../dom.js";

export const Y_SHARE = "% of the user's limit";
export const Y_RATE = "output tokens/s";

export const hhmm = (s) =>
  new Date(s * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });

// A bucket's start: with the day where buckets are 10 minutes or more (24 h, 7 days).
export const stamp = (s, step) =>
  step >= 600
    ? new Date(s * 1000).toLocaleString([], {
        month: "short",
        day: "numeric",
        hour: "2-digit",
        minute: "2-digit",
      })
    : hhmm(s);

// A share of the limit (0.943) as the percentage drawn (94.3).
export const pct = (share) => (share === null ? null : Math.round(share * 1000) / 10);
export const fmtPct = (v) => (v === null || v === undefined ? "–" : `${v}%`);
export const fmtTok = (v) => (v === null || v === undefined ? "–" : `${v.toFixed(1)} tok/s`);
export const fmtLimit = (v) =>
  v === null || v === undefined
    ? "unlimited"
    : `${Number.isInteger(v) ? fmtInt(v) : v.toFixed(1)} tok/s`;
