// The changes drawn on one user's chart, from the audit log (GET /audit?target=<user>):
// what was set and when, never read off bucket averages (a bucket spanning a change
// averages the two limits, and an engine-scoped limit sums over the engines reporting).

import { fmtRateUnit } from "../dom.js";

// The fields of a user's record that change the rate it is held to, in words.
const FIELDS = {
  output_tokens_per_second: ["override", (v) => (v === null ? "none" : fmtRateUnit(v))],
  tier: ["tier", (v) => v ?? "none"],
  scope: ["scope", (v) => v ?? "inherited"],
  enforcement: ["enforcement", (v) => v ?? "inherited"],
};

// An entry's before and after for this user: its own, or what a bulk change did to it.
function sides(entry) {
  if (entry.change) return [entry.change.before, entry.change.after];
  return [entry.before, entry.after];
}

// "override 20 tok/s → 60 tok/s; scope fleet → engine", or null when no such field changed.
function changeWords(before, after) {
  const parts = [];
  for (const [key, [name, words]] of Object.entries(FIELDS)) {
    const from = before?.[key] ?? null;
    const to = after?.[key] ?? null;
    if (from !== to) parts.push(`${name} ${words(from)} → ${words(to)}`);
  }
  return parts.length ? parts.join("; ") : null;
}

// The user's changes between the unix times since and until, oldest first: [{at (s), text}].
export function changeEvents(entries, since, until) {
  const events = [];
  for (const entry of entries) {
    const at = Date.parse(entry.at) / 1000;
    if (at < since || at > until) continue;
    const text = changeWords(...sides(entry));
    if (text) events.push({ at, text });
  }
  return events.sort((a, b) => a.at - b.at);
}
