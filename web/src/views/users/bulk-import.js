// Bulk import: CSV lines, each replacing one user's record. The server previews the
// import (one POST ?dry_run=true with the CSV as written): bad lines are named in the
// form, and whom it holds back is confirmed before anything is written.

import { api } from "../../api.js";
import { h, plural } from "../../dom.js";
import { confirmEffect, FieldError, handleSubmit } from "../../feedback.js";
import { impactLines } from "../../preview.js";

const CSV = { contentType: "text/csv" };

// The server's preview and the default (users without a record follow it); bad lines,
// each with its line number, stay in the form: nothing was written.
async function previewOf(body) {
  try {
    return await Promise.all([
      api("POST", "/limits:bulk?dry_run=true", body, CSV),
      api("GET", "/default-limit"),
    ]);
  } catch (error) {
    throw new FieldError("items", error.message);
  }
}

function confirmImport(preview, dflt) {
  const n = preview.num_users;
  const kept = preview.num_records_unchanged;
  const replaced = n - preview.num_created - kept;
  return confirmEffect(
    `Import ${plural(n, "user")}?`,
    [
      replaced
        ? `${plural(replaced, "existing user")}: ` +
          `${replaced === 1 ? "its record is" : "their records are"} replaced.`
        : null,
      kept ? `${plural(kept, "line")} equal to the stored record: nothing changes.` : null,
      ...impactLines(preview, { before: dflt, after: dflt }),
    ].filter(Boolean),
    `Import ${plural(n, "user")}`,
  );
}

// refresh: redraws the list of users.
export function bulkForm(refresh) {
  const text = h("textarea", {
    id: "bulk-text",
    rows: 5,
    "data-field": "items",
    placeholder:
      'user,tier,override,scope,enforcement,ceiling\nalice,pro\n"bob, inc",,50,engine,shadow,80',
  });
  const form = h(
    "form",
    { id: "bulk-form", class: "stack" },
    h(
      "p",
      { class: "hint" },
      "One user per line, 6 columns: user id, tier, override tok/s, scope (fleet or " +
        "engine), enforcement (enforce or shadow), borrowing ceiling tok/s (at least the " +
        "rate). Each line replaces that user's record: an empty or missing column clears " +
        "it (no scope, enforcement or ceiling: the tier's or the default's). " +
        'Quote a field that holds a comma ("acme, inc"); an optional first line of ' +
        "column names is skipped. The server checks every line and shows whom the " +
        "import holds back before anything is written.",
    ),
    h("div", { class: "field" }, h("label", { for: "bulk-text" }, "Lines (CSV)"), text),
    h("button", { type: "submit" }, "Preview and import"),
  );
  handleSubmit(form, async () => {
    const body = text.value;
    if (!body.trim()) throw new FieldError("items", "Lines: enter at least one line.");
    const [preview, dflt] = await previewOf(body);
    // A header or blank lines only: said as such, not as a choice to import 0 users.
    if (preview.num_users === 0 && preview.num_records_unchanged === 0)
      throw new FieldError("items", "Nothing to import: the lines hold no user (only a header?).");
    if (!(await confirmImport(preview, dflt))) return "Not imported.";
    const result = await api("POST", "/limits:bulk", body, CSV);
    text.value = "";
    await refresh();
    return `Imported: ${plural(result.num_changed, "user")} changed (version ${result.version}).`;
  });
  return form;
}
