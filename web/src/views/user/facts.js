// The user's limit as facts: the rate it gets and where from, its tier, override, scope,
// enforcement and borrowing ceiling (own or inherited) with what it borrowed, what a limit in
// shadow would have held back and what engines report it receives now.

import { fmtInt, fmtRateUnit, h } from "../../dom.js";

export const fmtTokens = (rate) => `${rate.toFixed(1)} tok/s`;

// Of the user's request-steps in `history` (GET /usage/history), the share a shadow limit
// would have refused; null without usage.
export function wouldThrottleShare(history) {
  const series = history.items[0];
  const numSteps = series ? series.tokens + series.throttled : 0;
  return numSteps ? Math.min(1, series.would_throttle / numSteps) : null;
}

function enforcementFact(view, inherit) {
  const mode =
    view.effective_enforcement === "shadow"
      ? "shadow: counted, not enforced"
      : view.effective_enforcement;
  const from =
    view.enforcement === null
      ? ` (inherited from ${inherit.enforcementFrom(view.tier)})`
      : " (its own)";
  return mode + from;
}

// The ceiling in force: none (the rate is a hard limit), or up to what it borrows and
// whose ceiling it is. A ceiling at or below the rate (set before the rate rose) borrows
// nothing.
function ceilingFact(view, inherit) {
  const own = view.ceiling_output_tokens_per_second;
  const effective = view.effective_ceiling_output_tokens_per_second;
  if (effective === null) {
    if (view.effective_output_tokens_per_second === null) return "none: it is unlimited";
    return own === null
      ? "none: the rate is a hard limit"
      : `none: its own ${fmtRateUnit(own)} is not above its rate`;
  }
  const from = own === null ? ` (inherited from ${inherit.ceilingFrom(view.tier)})` : " (its own)";
  return `up to ${fmtRateUnit(effective)} when no other user needs the capacity${from}`;
}

// What the user borrowed in `history` (GET /usage/history: its tokens, and of them those
// lent beyond its limit), said after its ceiling; nothing when it borrowed none and may not.
function borrowedWords(view, history) {
  const series = history.items[0];
  const borrowed = series ? series.borrowed : 0;
  if (
    !series?.tokens ||
    (borrowed === 0 && view.effective_ceiling_output_tokens_per_second === null)
  )
    return "";
  return `. Borrowed ${fmtInt(borrowed)} of its ${fmtInt(series.tokens)} tokens in the last hour`;
}

function wouldThrottleFact(view, wouldThrottle) {
  if (wouldThrottle === null) return "no usage reported in the last hour";
  const share = `${(wouldThrottle * 100).toFixed(1)}% of its request-steps in the last hour`;
  if (view.effective_enforcement === "shadow") return share;
  // Counted only while a limit is in shadow: a user enforced throughout has nothing here.
  if (wouldThrottle === 0)
    return "none: counted only under a shadow limit, and this user is enforced";
  return `${share} (while it was in shadow)`;
}

function facts(view, inherit, history) {
  return h(
    "dl",
    { class: "facts" },
    h("dt", {}, "Effective"),
    h(
      "dd",
      { id: "user-effective" },
      `${fmtRateUnit(view.effective_output_tokens_per_second)} (from the ${view.source})`,
    ),
    h("dt", {}, "Tier"),
    h("dd", {}, view.tier || "none"),
    h("dt", {}, "Override"),
    h(
      "dd",
      {},
      view.output_tokens_per_second === null ? "none" : fmtRateUnit(view.output_tokens_per_second),
    ),
    h("dt", {}, "Scope"),
    h(
      "dd",
      { id: "user-scope-effective" },
      view.scope === null
        ? `${view.effective_scope} (inherited from ${inherit.scopeFrom(view.tier)})`
        : `${view.effective_scope} (its own)`,
    ),
    h("dt", {}, "Enforcement"),
    h("dd", { id: "user-enforcement-effective" }, enforcementFact(view, inherit)),
    h("dt", {}, "Borrowing"),
    h(
      "dd",
      { id: "user-ceiling-effective" },
      ceilingFact(view, inherit) + borrowedWords(view, history),
    ),
    h("dt", {}, "Would be throttled"),
    h("dd", { id: "user-would-throttle" }, wouldThrottleFact(view, wouldThrottleShare(history))),
    h("dt", {}, "Received now"),
    h(
      "dd",
      { id: "user-received" },
      view.received_output_tokens_per_second === null
        ? "no engine reports it"
        : `${fmtTokens(view.received_output_tokens_per_second)} (all engines, last second)`,
    ),
  );
}

// The facts (`history`: the user's last hour, GET /usage/history), and for a user nobody
// configured, that saving creates it.
export function limitSummary(user, view, inherit, history) {
  return [
    facts(view, inherit, history),
    view.configured
      ? null
      : h(
          "p",
          { class: "notice" },
          `${user} is not configured: it gets the default limit. Saving below creates it.`,
        ),
  ].filter(Boolean);
}
