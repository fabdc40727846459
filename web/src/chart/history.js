// What the chart reads: GET /usage/history over a range, and each user's view (a shadow
// limit is drawn and labelled as such); for one user also its changes from the audit log.

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

async function viewsOf(users) {
  const views = await Promise.all(users.map((u) => api("GET", userPath(u)).catch(() => null)));
  return Object.fromEntries(users.map((u, i) => [u, views[i]]));
}

// One user's changes (its own and the bulk changes that touched it, newest first) and
// the number of engines connected (an engine-scoped limit holds on each).
async function userContext(user) {
  const [audit, engines] = await Promise.all([
    api("GET", `/audit?${new URLSearchParams({ target: user, limit: "200" })}`),
    api("GET", "/engines"),
  ]);
  return { audit: audit.items, numEngines: engines.items.filter((e) => e.connected).length };
}

// user: one user's history, else the TOP_N users first by `order` ("throttled" or
// "tokens"). Resolves to {data, modes: user -> its effective enforcement, views: user ->
// its GET /limits view} and, for one user, {audit, numEngines} (userContext).
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
  const users = user ? [user] : data.items.map((s) => s.user);
  const [views, context] = await Promise.all([viewsOf(users), user ? userContext(user) : {}]);
  const modes = Object.fromEntries(users.map((u) => [u, views[u]?.effective_enforcement]));
  return { data, modes, views, ...context };
}
