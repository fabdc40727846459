// The user's limit as facts: the rate it gets and where from, its tier, override, scope
// and enforcement (own or inherited), what a limit in shadow would have held back and
// what engines report it receives now.

import { fmtRateUnit, h } from "../../dom.js";

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

function wouldThrottleFact(view, wouldThrottle) {
  if (wouldThrottle === null) return "no usage reported in the last hour";
  return (
    `${(wouldThrottle * 100).toFixed(1)}% of its request-steps in the last hour` +
    (view.effective_enforcement === "shadow" ? "" : " (while in shadow)")
  );
}

function facts(view, inherit, wouldThrottle) {
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
    h("dt", {}, "Would be throttled"),
    h("dd", { id: "user-would-throttle" }, wouldThrottleFact(view, wouldThrottle)),
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

// The facts, and for a user nobody configured, that saving creates it.
export function limitSummary(user, view, inherit, wouldThrottle) {
  return [
    facts(view, inherit, wouldThrottle),
    view.configured
      ? null
      : h(
          "p",
          { class: "notice" },
          `${user} is not configured: it gets the default limit. Saving below creates it.`,
        ),
  ].filter(Boolean);
}
