// Deleting a tier: refused while users are in it, otherwise confirmed first.

import { api, tierPath } from "../../api.js";
import { fmtRateUnit, plural } from "../../dom.js";
import { confirmEffect, toast } from "../../feedback.js";

// refresh: redraws the view.
export async function deleteTier(tier, refresh) {
  if (tier.num_users) {
    await confirmEffect(
      `Tier ${tier.name} cannot be deleted`,
      [`${plural(tier.num_users, "user")} still in it: move them to another tier first.`],
      "OK",
    );
    return;
  }
  const ok = await confirmEffect(
    `Delete tier ${tier.name}?`,
    [`Tier ${tier.name} (${fmtRateUnit(tier.output_tokens_per_second)}) has no users.`],
    `Delete ${tier.name}`,
  );
  if (!ok) return;
  try {
    await api("DELETE", tierPath(tier.name));
    toast(`Tier ${tier.name} deleted.`);
  } catch (error) {
    toast(error.message, "error");
  }
  await refresh();
}
