// What a user without its own value gets: its tier's if the tier sets one, else the
// default's.

import { ceilingWords } from "../../rate-field.js";
import { enforcementWords, scopeWords } from "../../scope-field.js";

// tiers: GET /tiers items; dflt: GET /default-limit.
export function inheritance(tiers, dflt) {
  const tierOf = (name) => tiers.find((t) => t.name === name);
  return {
    tiers,
    // GET /default-limit: what a user without a record follows.
    dflt,
    defaultRate: dflt.output_tokens_per_second,
    // The rate a user with this tier (or null) and override (or null) is held to.
    rate: (tier, override) =>
      override !== null
        ? override
        : tier !== null
          ? (tierOf(tier)?.output_tokens_per_second ?? null)
          : dflt.output_tokens_per_second,
    // Where an inherited scope comes from, in words.
    scopeFrom: (tierName) => {
      const tierScope = tierOf(tierName)?.scope ?? null;
      return tierScope !== null
        ? `tier ${tierName}: ${tierScope}`
        : `the default: ${scopeWords(dflt.scope, "fleet")}`;
    },
    // Where an inherited enforcement comes from, likewise.
    enforcementFrom: (tierName) => {
      const own = tierOf(tierName)?.enforcement ?? null;
      return own !== null
        ? `tier ${tierName}: ${own}`
        : `the default: ${enforcementWords(dflt.enforcement, "enforce")}`;
    },
    // Where an inherited ceiling comes from, likewise.
    ceilingFrom: (tierName) => {
      const own = tierOf(tierName)?.ceiling_output_tokens_per_second ?? null;
      return own !== null
        ? `tier ${tierName}: ${ceilingWords(own)}`
        : `the default: ${ceilingWords(dflt.ceiling_output_tokens_per_second, "no borrowing")}`;
    },
  };
}
