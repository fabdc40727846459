// Rates as the tiers view's confirmations say them.

import { fmtInt, plural } from "../../dom.js";

export const rateWords = (rate) => (rate === null ? "unlimited" : fmtInt(rate));

// "1,114 users: 100 → unlimited tok/s"
export const effectLine = (numUsers, from, to) =>
  `${plural(numUsers, "user")}: ${rateWords(from)} → ${rateWords(to)} tok/s`;
