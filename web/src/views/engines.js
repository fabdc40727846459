// Engines: the version each applied, connected or not, the version its API server applied
// (its API keys), the fleet users it holds a share for, last seen; with replicas, the
// replica each engine core is connected to.

import { api } from "../api.js";
import { fmtInt, fmtTime, h, plural, section, table } from "../dom.js";

// The version the engine's API server applied: what its API keys are as of (none: no API
// server of the engine is connected, as without --output-rate-identity api-key).
function apiServerCell(applied, version) {
  if (applied === null) return h("td", {}, "none connected");
  const behind = applied < version;
  return h(
    "td",
    { class: behind ? "stale" : "" },
    behind ? `keys of ${applied} (behind)` : `keys of ${applied}`,
  );
}

// version: the current config version; replicas: whether to show each engine's replica.
function engineRow(e, version, replicas) {
  return h(
    "tr",
    { dataset: { engine: e.engine_id } },
    h("td", {}, e.engine_id),
    h("td", {}, e.model || "–"),
    h(
      "td",
      { class: e.applied_version < version ? "stale" : "" },
      e.applied_version < version ? `${e.applied_version} (behind)` : String(e.applied_version),
    ),
    h("td", {}, e.connected ? "yes" : "no"),
    ...(replicas ? [h("td", {}, e.home || "–")] : []),
    apiServerCell(e.api_applied_version, version),
    h("td", {}, fmtInt(e.num_shared_users)),
    h("td", {}, fmtTime(e.last_seen)),
  );
}

function enginesTable(items, version) {
  if (!items.length) return h("p", {}, "No engine has connected yet.");
  // Only replicas on PostgreSQL name a home; one control plane shows no such column.
  const replicas = items.some((e) => e.home);
  return table(
    "engines",
    [
      "Engine",
      "Model",
      "Applied version",
      "Connected",
      ...(replicas ? ["Replica"] : []),
      "API server",
      "Fleet users shared",
      "Last seen",
    ],
    items.map((e) => engineRow(e, version, replicas)),
    { id: "engines" },
    { stack: true },
  );
}

export async function render(main) {
  const box = h("div");
  main.replaceChildren(
    h("h2", { class: "view-title" }, "Engines"),
    section("Engines and applied versions", box),
  );
  async function refresh() {
    const { version, items } = await api("GET", "/engines");
    const behind = items.filter((e) => e.connected && e.applied_version < version).length;
    const applied = behind
      ? `${behind} connected not yet on it.`
      : "every connected engine applied it.";
    box.replaceChildren(
      h(
        "p",
        { class: "hint" },
        `Current config version ${version}. ${plural(items.length, "engine")}; ${applied}`,
      ),
      enginesTable(items, version),
    );
  }
  await refresh();
  return { refresh, interval: 2000 };
}
