// Opening a user by id. An id nobody configured is confirmed before its page opens (a
// typo would otherwise look like a new user); nothing is created until a save.

import { api } from "../../api.js";
import { h } from "../../dom.js";
import { confirmEffect, FieldError, handleSubmit } from "../../feedback.js";
import { link } from "../../router.js";

// Whether `user` is configured (has a row): the first id at or after it, by prefix.
async function isConfigured(user) {
  const { items } = await api("GET", `/limits?${new URLSearchParams({ q: user, limit: "1" })}`);
  return items.length > 0 && items[0].user === user;
}

async function openUser(user) {
  if (await isConfigured(user)) {
    location.hash = link("users", user);
    return true;
  }
  const ok = await confirmEffect(
    `User ${user} is not configured`,
    [
      `No user with the id “${user}” exists yet (check the spelling).`,
      "Continue to set a tier or an override for it; nothing is created until you save.",
    ],
    `Continue with ${user}`,
  );
  if (ok) location.hash = link("users", user, { new: "1" });
  return ok;
}

// The id typed, or a FieldError saying why it cannot be one.
function checkedId(typed) {
  const user = typed.trim();
  if (!user)
    throw new FieldError("user", "User id: enter the id your clients send as output_rate_user.");
  // biome-ignore lint/suspicious/noControlCharactersInRegex: finding them is the check.
  if (/[\x00-\x1f\x7f]/.test(user))
    throw new FieldError("user", "User id: control characters are not allowed.");
  return user;
}

// writer: an admin session (a viewer only looks: an unconfigured id shows the default
// that applies to it).
export function openUserForm(writer) {
  const id = h("input", {
    id: "open-user",
    autocomplete: "off",
    "data-field": "user",
    maxlength: 256,
  });
  const form = h(
    "form",
    { id: "open-user-form", class: "row", role: "search" },
    h("label", { for: "open-user" }, "User id"),
    id,
    h("button", { type: "submit" }, "Open user"),
  );
  handleSubmit(form, async () => {
    const user = checkedId(id.value);
    if (writer) await openUser(user);
    else location.hash = link("users", user);
    return null;
  });
  return form;
}
