// Deleting a tier: refused while users are in it, otherwise confirmed first. What the
// confirmation says is the tier as the server has it now, and the delete carries its ETag
// as If-Match: if someone else changed the tier since, nothing is deleted.

import { api, ConflictError, tierPath } from "../../api.js";
import { fmtRateUnit, plural } from "../../dom.js";
import { confirmEffect, toast } from "../../feedback.js";
import { loadTier } from "./edit-tier.js";

// refresh: redraws the view.
export async function deleteTier(listed, refresh) {
  try {
    const tier = await loadTier(listed.name);
    if (!tier) {
      toast(`Tier ${listed.name} no longer exists.`);
    } else if (tier.num_users) {
      await confirmEffect(
        `Tier ${tier.name} cannot be deleted`,
        [`${plural(tier.num_users, "user")} still in it: move them to another tier first.`],
        "OK",
      );
    } else {
      const ok = await confirmEffect(
        `Delete tier ${tier.name}?`,
        [`Tier ${tier.name} (${fmtRateUnit(tier.output_tokens_per_second)}) has no users.`],
        `Delete ${tier.name}`,
      );
      if (ok) {
        await api("DELETE", tierPath(tier.name), undefined, { ifMatch: tier.etag });
        toast(`Tier ${tier.name} deleted.`);
      }
    }
  } catch (error) {
    const changed = error instanceof ConflictError;
    toast(
      changed
        ? `Tier ${listed.name} changed since you confirmed: nothing was deleted. Check it and try again.`
        : error.message,
      "error",
    );
  }
  await refresh();
}
