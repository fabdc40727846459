// What a change would do, as the server computes it (?dry_run=true on the write): the
// lines of its confirmation. Counts are by the rate a user is *held* to (a shadow limit
// holds nobody), and the last hour of usage is compared with the new rate. The users it
// actually holds back (over the new limit in the last hour) are named first; the whole
// list can be downloaded as CSV.

import { fmtInt, fmtRateUnit, h, plural } from "./dom.js";

// Users named one by one in a confirmation; the rest are counted.
export const SHOWN_USERS = 20;

// A user's rate and enforcement in an item's state (null: no record, so the default's).
function limitOf(state, dflt) {
  return {
    rate: state ? state.effective_output_tokens_per_second : dflt.output_tokens_per_second,
    mode: state ? state.effective_enforcement : dflt.enforcement || "enforce",
  };
}

// The rate a user is held to, in words: a shadow limit holds nobody ("unlimited (shadow
// 30 tok/s)"); an enforced one is said "enforced" where the other side was in shadow.
function heldWords(limit, other) {
  if (limit.rate === null) return "unlimited";
  if (limit.mode === "shadow") return `unlimited (shadow ${fmtRateUnit(limit.rate)})`;
  const enforced = other.mode === "shadow" && other.rate !== null;
  return `${fmtRateUnit(limit.rate)}${enforced ? " enforced" : ""}`;
}

// "unlimited (shadow 30 tok/s) → 30 tok/s enforced"
function changeWords(item, defaults) {
  const before = limitOf(item.before, defaults.before);
  const after = limitOf(item.after, defaults.after);
  return `${heldWords(before, after)} → ${heldWords(after, before)}`;
}

// The users a change holds back now: a minute of the last hour over the new limit.
const heldBack = (item) => item.last_hour?.num_minutes_over_new_limit > 0;

function overWords(item) {
  const last = item.last_hour;
  if (!last?.num_minutes_over_new_limit) return "";
  return (
    `; used up to ${fmtInt(Math.round(last.peak_output_tokens_per_second))} tok/s in the ` +
    `last hour (${plural(last.num_minutes_over_new_limit, "minute")} over)`
  );
}

// "acme-1: 1,000 → 20 tok/s (override dropped); used up to 50 tok/s ..."
export function cutLine(item, defaults) {
  return (
    `${item.user}: ${changeWords(item, defaults)}` +
    (item.override_dropped ? " (override dropped)" : "") +
    (item.created ? " (new)" : "") +
    overWords(item)
  );
}

// A list of the first SHOWN_USERS lines and "and N more" (of `total`).
function userList(id, lines, total) {
  const more = total - Math.min(lines.length, SHOWN_USERS);
  return h(
    "ul",
    { id, class: "preview-users" },
    lines.slice(0, SHOWN_USERS).map((l) => h("li", {}, l)),
    more > 0 ? h("li", { class: "hint" }, `and ${fmtInt(more)} more (in the CSV below)`) : null,
  );
}

const csvField = (value) => {
  const text = value === null || value === undefined ? "" : String(value);
  return /[",\n\r]/.test(text) ? `"${text.replace(/"/g, '""')}"` : text;
};

// Every listed user as a CSV line: what the change does to the rate it is held to, and
// its last hour against the new limit.
function previewCsv(preview, defaults) {
  const header = [
    "user",
    "change",
    "before",
    "after",
    "override_dropped",
    "created",
    "peak_tok_s_last_hour",
    "minutes_over_new_limit",
  ];
  const lines = preview.items.map((item) => {
    const before = limitOf(item.before, defaults.before);
    const after = limitOf(item.after, defaults.after);
    return [
      item.user,
      item.change,
      heldWords(before, after),
      heldWords(after, before),
      item.override_dropped,
      item.created,
      item.last_hour ? item.last_hour.peak_output_tokens_per_second.toFixed(1) : "",
      item.last_hour ? item.last_hour.num_minutes_over_new_limit : "",
    ]
      .map(csvField)
      .join(",");
  });
  return `${[header.join(","), ...lines].join("\r\n")}\r\n`;
}

// The last download link's object URL (freed when the next confirmation makes its own).
let csvUrl = null;

// "Download all N users (CSV)": every user the preview lists.
function csvLink(preview, defaults) {
  if (csvUrl) URL.revokeObjectURL(csvUrl);
  csvUrl = URL.createObjectURL(new Blob([previewCsv(preview, defaults)], { type: "text/csv" }));
  const cut = preview.items_truncated ? ` (the first ${fmtInt(preview.items.length)})` : "";
  return h(
    "a",
    { href: csvUrl, download: `change-preview-v${preview.version}.csv`, id: "preview-csv" },
    `Download all ${plural(preview.items.length, "user")}${cut} as CSV`,
  );
}

// The confirmation's lines for `preview`. defaults: {before, after}, GET /default-limit
// before and after the change (users with no record follow it).
export function impactLines(preview, defaults) {
  const lines = [];
  const counts = [
    `${plural(preview.num_down, "user")} held to a lower rate`,
    `${fmtInt(preview.num_up)} to a higher one`,
    `${fmtInt(preview.num_same)} unchanged`,
  ];
  if (preview.num_created) counts.push(`${fmtInt(preview.num_created)} new`);
  lines.push(h("span", { id: "preview-counts" }, `${counts.join(", ")}.`));
  if (preview.num_down)
    lines.push(
      h(
        "span",
        { id: "preview-over" },
        `${plural(preview.num_over_new_limit, "of them", "of them")} used more than the ` +
          "new limit in the last hour.",
      ),
    );
  const cuts = preview.items.filter((i) => i.change === "down");
  // Those it holds back now first (as the server ordered them: largest cut first).
  const ordered = [...cuts.filter(heldBack), ...cuts.filter((i) => !heldBack(i))];
  if (cuts.length)
    lines.push(
      h(
        "div",
        {},
        preview.num_over_new_limit
          ? "Held to a lower rate (those over the new limit in the last hour first, " +
              "largest cut first):"
          : "Held to a lower rate (largest cut first):",
        userList(
          "preview-cuts",
          ordered.map((i) => cutLine(i, defaults)),
          preview.num_down,
        ),
      ),
    );
  if (preview.num_overrides_dropped) {
    const dropped = preview.items.filter((i) => i.override_dropped);
    lines.push(
      h(
        "div",
        {},
        `${plural(preview.num_overrides_dropped, "override")} dropped (the line sets none):`,
        userList(
          "preview-dropped",
          dropped.map((i) => `${i.user}: ${fmtRateUnit(i.before.output_tokens_per_second)}`),
          preview.num_overrides_dropped,
        ),
      ),
    );
  }
  if (preview.items.length) lines.push(csvLink(preview, defaults));
  return lines;
}
