// Users: find or open a user by id (users/open-user.js), the configured users with
// search, tier filter, sorting and pages (users/user-list.js), and for an admin the bulk
// import, previewed by the server and confirmed first (users/bulk-import.js).

import { h, section } from "../dom.js";
import { canWrite } from "../session.js";
import { bulkForm } from "./users/bulk-import.js";
import { openUserForm } from "./users/open-user.js";
import { userList } from "./users/user-list.js";

export async function render(main, route) {
  const writer = canWrite();
  const list = userList(route.params);
  main.replaceChildren(
    h("h2", { class: "view-title" }, "Users"),
    section(writer ? "Find or add a user" : "Find a user", openUserForm(writer)),
    list.el,
  );
  if (writer) main.append(section("Bulk import", bulkForm(list.refresh)));
  await list.refresh();
  return { refresh: list.refresh, interval: 10000 };
}
