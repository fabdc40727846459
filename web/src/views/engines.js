// Engines: the vLLM each runs, the version each applied, connected or not, the version its
// API server applied (its API keys), the fleet users it holds a share for, last seen; with
// replicas, the replica each engine core is connected to. A fleet on more than one vLLM
// release says so above the table, and so do two engines that share an id and an engine
// whose demand was flagged implausible.

import { api } from "../api.js";
import { fmtInt, fmtTime, h, plural, section, table } from "../dom.js";
import { confirmEffect, toast } from "../feedback.js";
import { canWrite } from "../session.js";

// "Forget": a disconnected engine's row goes (DELETE /engines/{id}), after a confirmation;
// a connected one has none (its row would come back at its next heartbeat).
function forgetCell(e, onForgot) {
  if (e.connected) return h("td", {});
  const forget = async () => {
    const ok = await confirmEffect(
      `Forget engine ${e.engine_id}?`,
      [
        `It is not connected (last seen ${fmtTime(e.last_seen)}). Its row leaves this list; ` +
          "if it connects again, it is listed again.",
      ],
      "Forget engine",
    );
    if (!ok) return;
    try {
      await api("DELETE", `/engines/${encodeURIComponent(e.engine_id)}`);
      toast(`Engine ${e.engine_id} forgotten.`);
    } catch (error) {
      toast(error.message, "error");
    }
    await onForgot();
  };
  return h(
    "td",
    { class: "actions" },
    h(
      "button",
      {
        type: "button",
        class: "secondary",
        "aria-label": `Forget engine ${e.engine_id}`,
        onclick: forget,
      },
      "Forget",
    ),
  );
}

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

// Engine ids a second engine tried to claim while they were live (GET /engines'
// refused_claims): two engines share the id, and the second gets no limit changes. The
// notice, or nothing.
function clashNotice(items) {
  const clashed = items.filter((e) => e.refused_claims > 0);
  if (!clashed.length) return [];
  const each = clashed.map(
    (e) =>
      `${e.engine_id}: ${plural(e.refused_claims, "claim")} refused, the last from ` +
      `${e.last_refused_claim_from || "an unknown address"} at ${fmtTime(e.last_refused_claim_at)}`,
  );
  return [
    h(
      "p",
      { class: "notice", role: "alert", id: "engine-id-clash" },
      `Two engines share an id (${each.join("; ")}). Give each engine its own ` +
        "--output-rate-engine-id.",
    ),
  ];
}

// Engines whose demand (the streams they say they run per fleet user) the control plane
// flagged implausible (GET /engines' implausible_demands): more than any queue of their
// capacity, or demand for too many users. Their claims are cut, but such an engine is
// misconfigured or not one the operator runs. The notice, or nothing.
function implausibleNotice(items) {
  const flagged = items.filter((e) => e.implausible_demands > 0);
  if (!flagged.length) return [];
  const each = flagged.map(
    (e) =>
      `${e.engine_id}: ${plural(e.implausible_demands, "report")} flagged, the last at ` +
      `${fmtTime(e.last_implausible_demand_at)} (${e.last_implausible_demand})`,
  );
  return [
    h(
      "p",
      { class: "notice", role: "alert", id: "implausible-demand" },
      `Implausible demand (${each.join("; ")}). Its claims are cut to its capacity; ` +
        "check that it is an engine you run and that its key is its own.",
    ),
  ];
}

// version: the current config version; replicas: whether to show each engine's replica.
// onForgot: redraws the list (writers only: null for a viewer).
function engineRow(e, version, replicas, onForgot) {
  return h(
    "tr",
    { dataset: { engine: e.engine_id } },
    h("td", {}, e.engine_id),
    h("td", {}, e.model || "–"),
    // null: the engine did not say (its vllm-output-rate predates it).
    h("td", {}, e.vllm_version ?? "unknown"),
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
    ...(onForgot ? [forgetCell(e, onForgot)] : []),
  );
}

function enginesTable(items, version, onForgot) {
  if (!items.length) return h("p", {}, "No engine has connected yet.");
  // Only replicas on PostgreSQL name a home; one control plane shows no such column.
  const replicas = items.some((e) => e.home);
  return table(
    "engines",
    [
      "Engine",
      "Model",
      "vLLM",
      "Applied version",
      "Connected",
      ...(replicas ? ["Replica"] : []),
      "API server",
      "Fleet users shared",
      "Last seen",
      ...(onForgot ? ["Actions"] : []),
    ],
    items.map((e) => engineRow(e, version, replicas, onForgot)),
    { id: "engines" },
    { stack: true },
  );
}

// The vLLM releases the connected engines run (a local label such as "+cpu" names a build of
// a release, not another one), with how many engines run each; null when they run one.
function mixedReleases(items) {
  const counts = new Map();
  for (const e of items) {
    if (!e.connected || !e.vllm_version) continue;
    const release = e.vllm_version.split("+")[0];
    counts.set(release, (counts.get(release) || 0) + 1);
  }
  if (counts.size < 2) return null;
  const releases = [...counts.keys()].sort((a, b) => a.localeCompare(b, "en", { numeric: true }));
  const each = releases.map((r) => `${r} on ${plural(counts.get(r), "engine")}`);
  return h(
    "p",
    { class: "notice", id: "vllm-releases" },
    `The connected engines run ${releases.length} vLLM releases: ${each.join(", ")}.`,
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
    const mixed = mixedReleases(items);
    box.replaceChildren(
      h(
        "p",
        { class: "hint" },
        `Current config version ${version}. ${plural(items.length, "engine")}; ${applied}`,
      ),
      ...(mixed ? [mixed] : []),
      ...clashNotice(items),
      ...implausibleNotice(items),
      enginesTable(items, version, canWrite() ? refresh : null),
    );
  }
  await refresh();
  return { refresh, interval: 2000 };
}
