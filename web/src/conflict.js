// A save refused because someone else changed the record since the form was drawn (the
// server's 412 to its If-Match; nothing was written): what changed, the values the
// operator saw, the server's now and the operator's own, and the operator's choice:
// redo the changes over the new values (back in the form, to review and save again) or
// discard them.

import { h } from "./dom.js";

const SAME = "(not changed by you)";

// rows: [{label, seen, now, mine}] in words (mine: null when the operator left it); only
// the fields someone else or the operator changed are listed. Resolves "redo" or
// "discard" (Escape discards: nothing is written either way).
export function showConflict({ title, lead, rows }) {
  const dialog = document.getElementById("conflict");
  document.getElementById("conflict-title").textContent = title;
  document.getElementById("conflict-lead").textContent = lead;
  const listed = rows.filter((row) => row.seen !== row.now || row.mine !== null);
  const unchanged = rows.filter((row) => !listed.includes(row)).map((row) => row.label);
  const body = listed.map((row) =>
    h(
      "tr",
      { class: row.seen === row.now ? "same" : "theirs", dataset: { field: row.label } },
      h("th", { scope: "row" }, row.label),
      h("td", { class: "seen", dataset: { label: "When you opened it" } }, row.seen),
      h("td", { class: "now", dataset: { label: "Saved since" } }, row.now),
      h("td", { class: "mine", dataset: { label: "Yours" } }, row.mine ?? SAME),
    ),
  );
  document.getElementById("conflict-fields").replaceChildren(
    h(
      "div",
      { class: "table-wrap" },
      h(
        "table",
        { class: "conflict stack-narrow", id: "conflict-table" },
        h("caption", { class: "visually-hidden" }, "what changed since you opened the form"),
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            ["", "When you opened it", "Saved since (now)", "Yours"].map((t) =>
              h("th", { scope: "col" }, t),
            ),
          ),
        ),
        h("tbody", {}, body),
      ),
    ),
    unchanged.length
      ? h(
          "p",
          { class: "hint", id: "conflict-unchanged" },
          `Unchanged: ${unchanged.join(", ").toLowerCase()}.`,
        )
      : null,
  );
  dialog.returnValue = "";
  return new Promise((resolve) => {
    dialog.addEventListener(
      "close",
      () => resolve(dialog.returnValue === "redo" ? "redo" : "discard"),
      { once: true },
    );
    dialog.showModal();
    document.getElementById("conflict-redo").focus();
  });
}

// What the toast says after the choice.
export const conflictWords = (what, choice) =>
  choice === "redo"
    ? `${what} changed since you opened it: nothing was saved. Your changes are back in ` +
      "the form over the new values: review them and save again."
    : `${what} changed since you opened it: nothing was saved; the form shows it as saved now.`;
