// Tiers and the default limit. Edits are merge patches of the fields that changed;
// changes that affect many users, remove a limit or hold anyone to a lower rate are
// confirmed with their effect, as the server previews it (?dry_run=true). The parts:
// tiers/default-limit.js, tiers/tier-table.js, tiers/edit-tier.js, tiers/new-tier.js,
// tiers/delete-tier.js.

import { api } from "../api.js";
import { h, section } from "../dom.js";
import { canWrite } from "../session.js";
import { defaultLimitSection } from "./tiers/default-limit.js";
import { deleteTier } from "./tiers/delete-tier.js";
import { editTierForm } from "./tiers/edit-tier.js";
import { newTierForm } from "./tiers/new-tier.js";
import { tiersTable } from "./tiers/tier-table.js";

export async function render(main) {
  const writer = canWrite();
  const tiersBox = h("div");
  const editBox = h("div", { id: "tier-edit" });
  let tiers = [];
  // The default's scope and enforcement (null: fleet, enforce), which tiers without
  // their own inherit.
  let defaults = { scope: null, enforcement: null };
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

  function edit(tier) {
    const close = () => editBox.replaceChildren();
    editBox.replaceChildren(editTierForm(tier, { defaults, close, refresh }));
    editBox.querySelector("h3").focus();
  }

  // forceDefault: redraw the default's form even if the default did not change.
  async function refresh(forceDefault = false) {
    const [{ items }, dflt] = await Promise.all([
      api("GET", "/tiers"),
      defaultLimit.refresh(forceDefault),
    ]);
    tiers = items;
    defaults = { scope: dflt.scope, enforcement: dflt.enforcement };
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
