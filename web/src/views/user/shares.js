// The shares of a fleet limit that engines hold for the user now (the fleet coordinator
// splits the limit by where the user's streams are).

import { h, table } from "../../dom.js";
import { fmtTokens } from "./facts.js";

export function sharesView(user, view) {
  if (view.effective_output_tokens_per_second === null)
    return h("p", { class: "hint" }, "Unlimited: no engine holds a share.");
  if (view.effective_scope === "engine")
    return h("p", { class: "hint" }, "Engine scope: each engine enforces the full limit.");
  if (!view.shares.length)
    return h(
      "p",
      { class: "hint" },
      "No engine holds a share now: engines serving the user start on an even part of the limit.",
    );
  return table(
    `shares of ${user}'s limit per engine`,
    ["Engine", "Share"],
    view.shares.map((share) =>
      h(
        "tr",
        { dataset: { engine: share.engine_id } },
        h("td", {}, share.engine_id),
        h("td", {}, fmtTokens(share.output_tokens_per_second)),
      ),
    ),
    { id: "user-shares-table" },
  );
}
