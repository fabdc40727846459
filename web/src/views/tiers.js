// Tiers and the default limit. Edits are merge patches of the fields that changed;
// changes that affect many users, remove a limit or hold anyone to a lower rate are
// confirmed with their effect, as the server previews it (?dry_run=true). The parts:
// tiers/default-limit.js, tiers/tier-table.js, tiers/edit-tier.js, tiers/new-tier.js,
// tiers/delete-tier.js.

import { api } from "../api.js";
import { h, section } from "../dom.js";
import { toast } from "../feedback.js";
import { canWrite } from "../session.js";
import { defaultLimitSection } from "./tiers/default-limit.js";
import { deleteTier } from "./tiers/delete-tier.js";
import { editTierForm, loadTier } from "./tiers/edit-tier.js";
import { newTierForm } from "./tiers/new-tier.js";
import { tiersTable } from "./tiers/tier-table.js";

export async function render(main) {
  const writer = canWrite();
  const tiersBox = h("div");
  const editBox = h("div", { id: "tier-edit" });
  let tiers = [];
  // The default's scope, enforcement and ceiling (null: fleet, enforce, no borrowing),
  // which tiers without their own inherit.
  let defaults = { scope: null, enforcement: null, ceiling: null };
  const defaultLimit = defaultLimitSection({ writer, onSaved: () => refresh(true) });
  main.replaceChildren(
    h("h2", { class: "view-title" }, "Tiers and default limit"),
    defaultLimit.el,
    section("Tiers", tiersBox, editBox),
  );
  if (writer)
    main.append(
      section(
        "New tier",
        newTierForm({ exists: (name) => tiers.some((t) => t.name === name), refresh }),
      ),
    );

  // The form is drawn from the tier as the server has it now, with its ETag.
  async function edit(listed) {
    const close = () => editBox.replaceChildren();
    const open = (tier, edits = null) => {
      editBox.replaceChildren(
        editTierForm(tier, { defaults, close, reopen: open, refresh, edits }),
      );
      editBox.querySelector("h3").focus();
    };
    try {
      const tier = await loadTier(listed.name);
      if (tier) open(tier);
      else {
        toast(`Tier ${listed.name} no longer exists.`, "error");
        await refresh();
      }
    } catch (error) {
      toast(error.message, "error");
    }
  }

  // forceDefault: redraw the default's form even if the default did not change.
  async function refresh(forceDefault = false) {
    const [{ items }, dflt] = await Promise.all([
      api("GET", "/tiers"),
      defaultLimit.refresh(forceDefault),
    ]);
    tiers = items;
    defaults = {
      scope: dflt.scope,
      enforcement: dflt.enforcement,
      ceiling: dflt.ceiling_output_tokens_per_second,
    };
    tiersBox.replaceChildren(
      tiersTable(items, {
        writer,
        defaults,
        onEdit: edit,
        onDelete: (tier) => deleteTier(tier, refresh),
      }),
    );
  }
  await refresh();
  return { refresh, interval: 5000 };
}
