// Access tokens: create and revoke read-only viewer tokens (admin only).

import { api } from "../api.js";
import { fmtTime, h, section, table } from "../dom.js";
import { confirmEffect, FieldError, handleSubmit, toast } from "../feedback.js";
import { canWrite } from "../session.js";

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
  main.append(
    section("Viewer tokens (read-only access)", box),
    section(
      "New viewer token",
      h("p", { class: "hint" }, "A viewer token can read everything and change nothing."),
      form,
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
            items.map((t) =>
              h(
                "tr",
                { dataset: { token: String(t.id) } },
                h("td", {}, t.name),
                h("td", {}, fmtTime(t.created_at)),
                h("td", {}, t.revoked ? "revoked" : "active"),
                h(
                  "td",
                  {},
                  t.revoked
                    ? ""
                    : h(
                        "button",
                        {
                          type: "button",
                          class: "danger",
                          "aria-label": `Revoke token ${t.name}`,
                          onclick: async () => {
                            const ok = await confirmEffect(
                              `Revoke token ${t.name}?`,
                              [`Anyone using “${t.name}” loses read access at once.`],
                              `Revoke ${t.name}`,
                            );
                            if (!ok) return;
                            try {
                              await api("DELETE", `/tokens/${t.id}`);
                              toast(`Token “${t.name}” revoked.`);
                              await refresh();
                            } catch (error) {
                              toast(error.message, "error");
                            }
                          },
                        },
                        "Revoke",
                      ),
                ),
              ),
            ),
            { id: "tokens" },
            { stack: true },
          )
        : h("p", { class: "hint" }, "No viewer tokens yet."),
    );
  }
  await refresh();
  return { refresh, interval: 10000 };
}
