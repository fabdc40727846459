// Access tokens: create and revoke read-only viewer tokens (admin only).

import { api } from "../api.js";
import { fmtTime, h, section, table } from "../dom.js";
import { confirmEffect, FieldError, handleSubmit, toast } from "../feedback.js";
import { canWrite } from "../session.js";

// refresh: redraws the list.
async function revoke(token, refresh) {
  const ok = await confirmEffect(
    `Revoke token ${token.name}?`,
    [`Anyone using “${token.name}” loses read access at once.`],
    `Revoke ${token.name}`,
  );
  if (!ok) return;
  try {
    await api("DELETE", `/tokens/${token.id}`);
    toast(`Token “${token.name}” revoked.`);
    await refresh();
  } catch (error) {
    toast(error.message, "error");
  }
}

function tokenRow(token, refresh) {
  return h(
    "tr",
    { dataset: { token: String(token.id) } },
    h("td", {}, token.name),
    h("td", {}, fmtTime(token.created_at)),
    h("td", {}, token.revoked ? "revoked" : "active"),
    h(
      "td",
      {},
      token.revoked
        ? ""
        : h(
            "button",
            {
              type: "button",
              class: "danger",
              "aria-label": `Revoke token ${token.name}`,
              onclick: () => revoke(token, refresh),
            },
            "Revoke",
          ),
    ),
  );
}

// The new token's secret is shown once, in `created`; refresh: redraws the list.
function createForm(created, refresh) {
  const name = h("input", {
    id: "token-name",
    autocomplete: "off",
    "data-field": "name",
    maxlength: 128,
  });
  const form = h(
    "form",
    { id: "token-create", class: "stack" },
    h(
      "div",
      { class: "field" },
      h("label", { for: "token-name" }, "Name (who or what uses it)"),
      name,
    ),
    h("button", { type: "submit" }, "Create viewer token"),
  );
  handleSubmit(form, async () => {
    const value = name.value.trim();
    if (!value)
      throw new FieldError(
        "name",
        "Name: enter a name, e.g. the dashboard that will use the token.",
      );
    const result = await api("POST", "/tokens", { name: value });
    created.replaceChildren(
      h(
        "div",
        { class: "notice" },
        h("p", {}, `Token for “${result.name}” (shown only now; copy it):`),
        h("code", { id: "new-token", tabindex: "0" }, result.token),
      ),
    );
    form.reset();
    await refresh();
    return `Viewer token “${result.name}” created.`;
  });
  return form;
}

export async function render(main) {
  main.replaceChildren(h("h2", { class: "view-title" }, "Access tokens"));
  if (!canWrite()) {
    main.append(
      section(
        "Viewer tokens",
        h(
          "p",
          {},
          "Only the admin token can see and manage access tokens. This session is read-only.",
        ),
      ),
    );
    return {};
  }
  const box = h("div");
  const created = h("div", { "aria-live": "polite" });
  main.append(
    section("Viewer tokens (read-only access)", box),
    section(
      "New viewer token",
      h("p", { class: "hint" }, "A viewer token can read everything and change nothing."),
      createForm(created, refresh),
      created,
    ),
  );

  async function refresh() {
    const { items } = await api("GET", "/tokens");
    box.replaceChildren(
      items.length
        ? table(
            "viewer tokens",
            ["Name", "Created", "State", ""],
            items.map((t) => tokenRow(t, refresh)),
            { id: "tokens" },
            { stack: true },
          )
        : h("p", { class: "hint" }, "No viewer tokens yet."),
    );
  }
  await refresh();
  return { refresh, interval: 10000 };
}
