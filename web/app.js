// Admin console for the vllm-output-rate control plane: a hash router over views, each
// in its own module under src/views/. Talks only to the server that serves it.

import { api, getToken, setToken } from "./src/api.js";
import { h } from "./src/dom.js";
import { toast } from "./src/feedback.js";
import { parseHash } from "./src/router.js";
import { canWrite, detectRole, session } from "./src/session.js";
import * as audit from "./src/views/audit.js";
import * as engines from "./src/views/engines.js";
import * as overview from "./src/views/overview.js";
import * as tiers from "./src/views/tiers.js";
import * as tokens from "./src/views/tokens.js";
import * as user from "./src/views/user.js";
import * as users from "./src/views/users.js";

const VIEWS = { overview, tiers, users, engines, audit, tokens };
const TITLES = {
  overview: "Overview",
  tiers: "Tiers",
  users: "Users",
  engines: "Engines",
  audit: "Audit log",
  tokens: "Access tokens",
};
const main = document.getElementById("view");
let current = null;
let timer = null;
let generation = 0;

function showRole() {
  const role = document.getElementById("role");
  role.hidden = !session.role;
  role.textContent = session.role === "admin" ? "admin" : "read-only";
  document.getElementById("readonly").hidden = session.role !== "viewer";
  document.body.classList.toggle("viewer", session.role === "viewer");
}

async function showVersion() {
  try {
    const { version } = await api("GET", "/engines");
    document.getElementById("version").textContent = `v${version}`;
  } catch (_) {
    /* shown by the view */
  }
}

async function route({ focus = true } = {}) {
  const mine = ++generation;
  clearInterval(timer);
  if (current?.destroy) current.destroy();
  current = null;
  const r = parseHash();
  delete main.dataset.ready;
  const module = r.view === "users" && r.arg !== null ? user : VIEWS[r.view];
  for (const a of document.querySelectorAll("#nav a")) {
    if (a.dataset.view === r.view) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  if (!session.role) {
    main.replaceChildren(
      h(
        "section",
        { class: "card" },
        h("h2", { class: "view-title" }, "Sign in"),
        h(
          "p",
          {},
          getToken()
            ? "The token was not accepted. Enter the admin token or a viewer token above."
            : "Enter the admin token (may change limits) or a viewer token (read-only) above.",
        ),
      ),
    );
    return;
  }
  if (!module) {
    main.replaceChildren(
      h("h2", { class: "view-title" }, "Not found"),
      h("p", {}, "No such view. Use the navigation above."),
    );
    return;
  }
  document.title = `${r.arg ? `${r.arg} · ` : ""}${TITLES[r.view] || r.view} · vllm-output-rate`;
  try {
    const view = await module.render(main, r);
    if (mine !== generation) {
      if (view?.destroy) view.destroy();
      return;
    }
    current = view || {};
    main.dataset.ready = r.arg === null ? r.view : `${r.view}/${r.arg}`; // rendered with data
    if (focus) {
      const title = main.querySelector(".view-title");
      if (title) {
        title.tabIndex = -1;
        title.focus();
      }
    }
    if (current.refresh) {
      timer = setInterval(async () => {
        try {
          await current.refresh();
        } catch (error) {
          toast(error.message, "error");
        }
        showVersion();
      }, current.interval || 5000);
    }
    showVersion();
  } catch (error) {
    main.replaceChildren(
      h("h2", { class: "view-title" }, TITLES[r.view] || "Error"),
      h("p", { class: "field-error", role: "alert" }, error.message),
    );
  }
}

document.getElementById("token").value = getToken();
document.getElementById("token-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  setToken(document.getElementById("token").value.trim());
  await detectRole();
  showRole();
  if (session.role)
    toast(session.role === "admin" ? "Signed in as admin." : "Signed in read-only (viewer token).");
  route();
});
window.addEventListener("hashchange", () => route());

(async () => {
  try {
    await detectRole();
  } catch (error) {
    toast(error.message, "error");
  }
  showRole();
  await route({ focus: false });
})();

export { canWrite };
