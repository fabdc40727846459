// Admin UI for the vllm-output-rate control plane. Talks to the REST API of
// the server that serves it; the token lives in this browser's localStorage.

const $ = (selector) => document.querySelector(selector);
const TOKEN_KEY = "output-rate-token";
const HISTORY_POINTS = 120;

let currentVersion = 0;
// user -> { rates: number[], limit: number|null } for the chart
const history = new Map();
const times = [];
let chart = null;
let chartUsers = [];

function status(message, isError = false, source = "action") {
  const el = $("#status");
  el.textContent = message;
  el.className = isError ? "error" : "";
  el.dataset.source = source;
}

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${localStorage.getItem(TOKEN_KEY) || ""}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!response.ok) {
    let detail = response.statusText;
    try {
      const data = await response.json();
      detail = data.message || (typeof data.detail === "string" ? data.detail : JSON.stringify(data.detail));
    } catch (_) { /* not JSON */ }
    throw new Error(`${method} ${path}: ${response.status} ${detail}`);
  }
  return response.status === 204 ? null : response.json();
}

function rateOrNull(input) {
  const text = input.value.trim();
  return text === "" ? null : Number(text);
}

const fmtRate = (rate) => (rate === null || rate === undefined ? "unlimited" : String(rate));

function cell(text) {
  const td = document.createElement("td");
  td.textContent = text;
  return td;
}

function removeButton(label, onClick) {
  const td = document.createElement("td");
  const button = document.createElement("button");
  button.className = "link";
  button.textContent = label;
  button.addEventListener("click", onClick);
  td.append(button);
  return td;
}

async function guarded(action) {
  try {
    await action();
    status("");
  } catch (error) {
    status(error.message, true);
  }
}

// The live poll may only clear what it reported itself: an operator's failed
// action stays on screen until their next action.
async function polled(action) {
  try {
    await action();
    if ($("#status").dataset.source === "poll") status("");
  } catch (error) {
    status(error.message, true, "poll");
  }
}

async function loadDefault() {
  const data = await api("GET", "/default-limit");
  $("#default-rate").value = data.output_tokens_per_second ?? "";
}

async function loadTiers() {
  const { items } = await api("GET", "/tiers");
  const body = $("#tiers tbody");
  body.replaceChildren();
  const select = $("#user-tier");
  select.replaceChildren(new Option("(no tier)", ""));
  for (const tier of items) {
    const tr = document.createElement("tr");
    tr.dataset.tier = tier.name;
    tr.append(
      cell(tier.name),
      cell(fmtRate(tier.output_tokens_per_second)),
      cell(tier.description || ""),
      cell(String(tier.num_users)),
      removeButton("delete", () => guarded(async () => {
        await api("DELETE", `/tiers/${encodeURIComponent(tier.name)}`);
        await refreshConfig();
      })),
    );
    body.append(tr);
    select.append(new Option(tier.name, tier.name));
  }
}

const USERS_PER_PAGE = 100;
// The cursor of each page walked through ("after" this user id); "" is the first page.
// Cursor paging stays fast with a million users, where a deep offset would not.
let userCursors = [""];

async function loadUsers() {
  const q = $("#search").value.trim();
  const params = new URLSearchParams({ limit: String(USERS_PER_PAGE) });
  if (q) params.set("q", q);
  const after = userCursors[userCursors.length - 1];
  if (after) params.set("after", after);
  const { items, total } = await api("GET", `/limits?${params}`);
  const first = (userCursors.length - 1) * USERS_PER_PAGE;
  const shown = items.length ? ` (showing ${first + 1}–${first + items.length})` : "";
  $("#users-total").textContent = `${total} configured user${total === 1 ? "" : "s"}${shown}`;
  $("#users-prev").disabled = userCursors.length === 1;
  const next = $("#users-next");
  next.disabled = items.length < USERS_PER_PAGE;
  next.dataset.after = items.length ? items[items.length - 1].user : "";
  const body = $("#users tbody");
  body.replaceChildren();
  for (const user of items) {
    const tr = document.createElement("tr");
    tr.dataset.user = user.user;
    tr.append(
      cell(user.user),
      cell(user.tier || ""),
      cell(user.output_tokens_per_second ?? ""),
      cell(fmtRate(user.effective_output_tokens_per_second)),
      cell(user.source),
      removeButton("remove", () => guarded(async () => {
        await api("DELETE", `/limits/${encodeURIComponent(user.user)}`);
        await refreshConfig();
      })),
    );
    body.append(tr);
  }
}

async function loadEngines() {
  const { version, items } = await api("GET", "/engines");
  currentVersion = version;
  $("#version").textContent = `v${version}`;
  const body = $("#engines tbody");
  body.replaceChildren();
  for (const engine of items) {
    const tr = document.createElement("tr");
    tr.dataset.engine = engine.engine_id;
    const applied = cell(String(engine.applied_version));
    if (engine.applied_version < version) applied.className = "stale";
    tr.append(
      cell(engine.engine_id),
      cell(engine.model || ""),
      applied,
      cell(engine.connected ? "yes" : "no"),
      cell(new Date(engine.last_seen).toLocaleTimeString()),
    );
    body.append(tr);
  }
}

function ensureChart(users) {
  const same = users.length === chartUsers.length && users.every((u, i) => u === chartUsers[i]);
  if (chart && same) return;
  chartUsers = users;
  if (chart) chart.destroy();
  const palette = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];
  const series = [{}];
  users.forEach((user, i) => {
    const color = palette[i % palette.length];
    series.push({ label: `${user} tok/s`, stroke: color, width: 2 });
    series.push({ label: `${user} limit`, stroke: color, dash: [6, 4], width: 1 });
  });
  const width = Math.max(400, $("#chart").clientWidth || 800);
  chart = new uPlot({ width, height: 260, series, scales: { x: { time: true } } }, [[]], $("#chart"));
}

async function loadUsage() {
  const { items } = await api("GET", "/usage");
  const body = $("#usage tbody");
  body.replaceChildren();
  const now = Date.now() / 1000;
  times.push(now);
  for (const item of items) {
    if (!history.has(item.user)) {
      history.set(item.user, { rates: Array(times.length - 1).fill(null), limits: Array(times.length - 1).fill(null) });
    }
    const tr = document.createElement("tr");
    tr.dataset.user = item.user;
    tr.append(
      cell(item.user),
      cell(item.output_tokens_per_second_1s.toFixed(0)),
      cell(item.output_tokens_per_second_10s.toFixed(1)),
      cell(fmtRate(item.limit)),
      cell(`${Math.round(item.throttled_fraction * 100)}%`),
    );
    body.append(tr);
  }
  const seen = new Map(items.map((item) => [item.user, item]));
  for (const [user, h] of history) {
    const item = seen.get(user);
    h.rates.push(item ? item.output_tokens_per_second_1s : null);
    h.limits.push(item ? item.limit : null);
  }
  while (times.length > HISTORY_POINTS) {
    times.shift();
    for (const h of history.values()) { h.rates.shift(); h.limits.shift(); }
  }
  const users = [...history.keys()].sort();
  if (users.length === 0) return;
  ensureChart(users);
  const data = [times.slice()];
  for (const user of users) {
    data.push(history.get(user).rates.slice());
    data.push(history.get(user).limits.slice());
  }
  chart.setData(data);
}

async function refreshConfig() {
  await Promise.all([loadDefault(), loadTiers(), loadUsers(), loadEngines()]);
}

function wireForms() {
  $("#token").value = localStorage.getItem(TOKEN_KEY) || "";
  $("#token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    localStorage.setItem(TOKEN_KEY, $("#token").value.trim());
    guarded(refreshConfig);
  });
  $("#default-form").addEventListener("submit", (event) => {
    event.preventDefault();
    guarded(async () => {
      await api("PUT", "/default-limit", { output_tokens_per_second: rateOrNull($("#default-rate")) });
      await refreshConfig();
    });
  });
  $("#tier-form").addEventListener("submit", (event) => {
    event.preventDefault();
    guarded(async () => {
      const name = $("#tier-name").value.trim();
      await api("PUT", `/tiers/${encodeURIComponent(name)}`, {
        output_tokens_per_second: rateOrNull($("#tier-rate")),
        description: $("#tier-description").value,
      });
      $("#tier-form").reset();
      await refreshConfig();
    });
  });
  $("#user-form").addEventListener("submit", (event) => {
    event.preventDefault();
    guarded(async () => {
      const user = $("#user-id").value.trim();
      await api("PUT", `/limits/${encodeURIComponent(user)}`, {
        tier: $("#user-tier").value || null,
        output_tokens_per_second: rateOrNull($("#user-rate")),
      });
      $("#user-form").reset();
      await refreshConfig();
    });
  });
  $("#search-form").addEventListener("submit", (event) => {
    event.preventDefault();
    userCursors = [""];
    guarded(loadUsers);
  });
  $("#users-next").addEventListener("click", () => {
    userCursors.push($("#users-next").dataset.after);
    guarded(loadUsers);
  });
  $("#users-prev").addEventListener("click", () => {
    if (userCursors.length > 1) userCursors.pop();
    guarded(loadUsers);
  });
}

wireForms();
guarded(refreshConfig);
setInterval(() => polled(async () => { await loadEngines(); await loadUsage(); }), 1000);
