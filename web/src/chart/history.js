// What the chart reads: GET /usage/history over a range, and each user's enforcement (a
// shadow limit is drawn and labelled as such).

import { api, userPath } from "../api.js";

export const TOP_N = 8;
// range -> [seconds, step, label]; 7 days of 10-minute buckets is 1,008 points (the
// server answers at most 1,440).
export const RANGES = {
  "15m": [900, 60, "15 min"],
  "1h": [3600, 60, "1 h"],
  "24h": [86400, 600, "24 h"],
  "7d": [7 * 86400, 600, "7 days"],
};

async function enforcementOf(users) {
  const views = await Promise.all(users.map((u) => api("GET", userPath(u)).catch(() => null)));
  return Object.fromEntries(users.map((u, i) => [u, views[i]?.effective_enforcement]));
}

// user: one user's history, else the TOP_N users first by `order` ("throttled" or
// "tokens"). Resolves to {data, modes: user -> its effective enforcement}.
export async function loadHistory({ user, range, order }) {
  const [seconds, step] = RANGES[range];
  const params = new URLSearchParams({
    since: new Date(Date.now() - seconds * 1000).toISOString(),
    step: String(step),
  });
  if (user) params.set("user", user);
  else {
    params.set("top", String(TOP_N));
    params.set("order", order);
  }
  const data = await api("GET", `/usage/history?${params}`);
  const modes = await enforcementOf(data.items.map((s) => s.user));
  return { data, modes };
}
