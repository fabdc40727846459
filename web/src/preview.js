// What a change would do, as the server computes it (?dry_run=true on the write): the
// lines of its confirmation. Counts are by the rate a user is *held* to (a shadow limit
// holds nobody), and the last hour of usage is compared with the new rate.

import { fmtInt, fmtRateUnit, h, plural } from "./dom.js";

// Users named one by one in a confirmation; the rest are counted.
export const SHOWN_USERS = 20;

// A user's rate in an item's state (null: no record, so the default's).
function rateWords(state, dflt) {
  const rate = state ? state.effective_output_tokens_per_second : dflt.output_tokens_per_second;
  const mode = state ? state.effective_enforcement : dflt.enforcement || "enforce";
  return rate !== null && mode === "shadow" ? `${fmtRateUnit(rate)} (shadow)` : fmtRateUnit(rate);
}

function overWords(item) {
  const last = item.last_hour;
  if (!last?.num_minutes_over_new_limit) return "";
  return (
    `; used up to ${fmtInt(Math.round(last.peak_output_tokens_per_second))} tok/s in the ` +
    `last hour (${plural(last.num_minutes_over_new_limit, "minute")} over)`
  );
}

// "acme-1: 1,000 → 20 tok/s (override dropped); used up to 50 tok/s ..."
function cutLine(item, defaults) {
  return (
    `${item.user}: ${rateWords(item.before, defaults.before)} → ` +
    `${rateWords(item.after, defaults.after)}` +
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
    more > 0 ? h("li", { class: "hint" }, `and ${fmtInt(more)} more`) : null,
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
  if (cuts.length)
    lines.push(
      h(
        "div",
        {},
        "Held to a lower rate (largest cut first):",
        userList(
          "preview-cuts",
          cuts.map((i) => cutLine(i, defaults)),
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
  return lines;
}
