// A user's API keys on the user page: the list (anyone), creation and revocation (admin).
// A new key's secret is shown once, in this section's own box, which the periodic refresh
// never touches; it lives only in the DOM, is removed when dismissed, when the view goes
// away or the page is hidden, and is never written to storage or the address.

import { api } from "./api.js";
import { fmtTime, h, table } from "./dom.js";
import { confirmEffect, handleSubmit, toast } from "./feedback.js";
import { canWrite } from "./session.js";

const userKeysPath = (user) => `/users/${encodeURIComponent(user)}/keys`;
const keyPath = (id) => `/keys/${encodeURIComponent(id)}`;

// navigator.clipboard exists only in a secure context (https or localhost) and may be
// refused; then the key is selected so that the operator's own Ctrl+C copies it.
async function copyOrSelect(input, status) {
  try {
    await navigator.clipboard.writeText(input.value);
    status.textContent = "Copied to the clipboard.";
    return;
  } catch (_) {
    /* no clipboard here: select instead */
  }
  input.focus();
  input.select();
  status.textContent = "The key is selected: press Ctrl+C (⌘C on a Mac) to copy it.";
}

export function apiKeysSection(user) {
  const writer = canWrite();
  const listBox = h("div", { id: "user-keys" });
  const secretBox = h("div", { id: "new-key-box" });
  let shownList = null;
  let shownKeyId = null;

  function dismissSecret() {
    // The input goes with its box: nothing keeps the key once it is dismissed.
    secretBox.replaceChildren();
    shownKeyId = null;
  }

  function showSecret(created) {
    const input = h("input", {
      id: "new-key",
      type: "text",
      readonly: true,
      autocomplete: "off",
      spellcheck: "false",
      "aria-describedby": "new-key-once",
    });
    input.value = created.key;
    const status = h("p", { class: "hint", id: "new-key-status", "aria-live": "polite" });
    const copy = h(
      "button",
      { type: "button", id: "new-key-copy", onclick: () => copyOrSelect(input, status) },
      "Copy",
    );
    secretBox.replaceChildren(
      h(
        "div",
        { class: "notice secret-key" },
        h("label", { for: "new-key" }, `New API key of ${user}`),
        h("div", { class: "row" }, input, copy),
        h(
          "p",
          { id: "new-key-once" },
          "This is the only time the key is shown: copy it now. It is not stored here and " +
            "cannot be shown again; if it is lost, revoke it and create another.",
        ),
        status,
        h(
          "button",
          { type: "button", class: "secondary", id: "new-key-done", onclick: onDone },
          "Done: hide the key",
        ),
      ),
    );
    shownKeyId = created.id;
    input.focus();
    input.select();
  }

  function onDone() {
    dismissSecret();
    document.getElementById("key-create-button")?.focus();
  }

  async function revoke(key) {
    const ok = await confirmEffect(
      `Revoke API key ${key.prefix}?`,
      [
        `Requests with the key ${key.prefix}… are refused by every engine within a moment.`,
        "This cannot be undone: whoever uses it needs a new key. " +
          `The other keys of ${user} keep working.`,
      ],
      `Revoke ${key.prefix}`,
    );
    if (!ok) return;
    try {
      await api("DELETE", keyPath(key.id));
      toast(`API key ${key.prefix} of ${user} revoked.`);
    } catch (error) {
      if (error.status !== 404) {
        toast(error.message, "error");
        return;
      }
      toast(`API key ${key.prefix} was already revoked.`);
    }
    if (shownKeyId === key.id) dismissSecret();
    await refresh();
  }

  function keyRow(key) {
    return h(
      "tr",
      { dataset: { key: key.id } },
      h("td", {}, h("code", {}, key.prefix)),
      h("td", {}, fmtTime(key.created_at)),
      h("td", {}, key.last_used_at === null ? "never" : fmtTime(key.last_used_at)),
      writer
        ? h(
            "td",
            { class: "actions" },
            h(
              "button",
              {
                type: "button",
                class: "danger",
                "aria-label": `Revoke API key ${key.prefix}`,
                onclick: () => revoke(key),
              },
              "Revoke",
            ),
          )
        : null,
    );
  }

  async function refresh() {
    const { items } = await api("GET", userKeysPath(user));
    // Redrawn only when the keys changed, so a focused Revoke button keeps the focus.
    const key = JSON.stringify(items);
    if (key === shownList) return items;
    shownList = key;
    listBox.replaceChildren(
      items.length
        ? table(
            `API keys of ${user}`,
            ["Key", "Created", "Last used", ...(writer ? [""] : [])],
            items.map(keyRow),
            { id: "user-keys-table" },
            { stack: true },
          )
        : h("p", { class: "hint" }, "No API keys."),
    );
    return items;
  }

  let form = null;
  if (writer) {
    form = h(
      "form",
      { id: "key-create", class: "stack" },
      h("button", { type: "submit", id: "key-create-button" }, "Create key"),
    );
    handleSubmit(form, async () => {
      const created = await api("POST", userKeysPath(user));
      // Shown before anything else can fail: this response is the only copy of the key.
      showSecret(created);
      const items = await refresh();
      const prefix = items.find((k) => k.id === created.id)?.prefix ?? created.id;
      return `API key ${prefix} created for ${user}.`;
    });
  }

  // A page put away (another site, a closed tab kept in the back-forward cache) comes
  // back without the key.
  window.addEventListener("pagehide", dismissSecret);

  return {
    el: h(
      "div",
      {},
      h(
        "p",
        { class: "hint" },
        `Keys that identify ${user} to engines started with `,
        h("code", {}, "--output-rate-identity api-key"),
        " (sent as ",
        h("code", {}, "Authorization: Bearer <key>"),
        ").",
      ),
      listBox,
      form,
      secretBox,
    ),
    refresh,
    destroy() {
      window.removeEventListener("pagehide", dismissSecret);
      dismissSecret();
    },
  };
}
