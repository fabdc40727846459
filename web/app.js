// Admin console for the vllm-output-rate control plane: a hash router over views, each
// in its own module under src/views/. Talks only to the server that serves it.

import { api, getToken, setToken } from "./src/api.js";
import { isDown, isOutage, onConnectionChange } from "./src/connection.js";
import { h } from "./src/dom.js";
import { toast } from "./src/feedback.js";
import { parseHash } from "./src/router.js";
import { canWrite, detectRole, session, signOut } from "./src/session.js";
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
// While the control plane does not answer, a view (or a view that could not be drawn)
// tries again this often, whatever its own refresh interval.
const RETRY_MS = 2000;
// When the view shown last drew data from the server (ms since the epoch; null: none).
let drawnAt = null;
// Forms of the view the operator typed into (search forms aside). The periodic refresh
// redraws the view as before, but a typed form it replaced is put back as the operator
// left it; if the redrawn one differed (the data behind it changed), a notice says so
// and offers a reload. A form leaves the set when it is reset, replaced by the view
// itself (after a save) or submitted (one that kept a field error still counts).
const typed = new WeakSet();
const SEARCH = "[role=search]";
function markTyped(event) {
  const form = event.target.closest?.("form");
  if (form && !form.matches(SEARCH)) typed.add(form);
}
main.addEventListener("input", markTyped);
main.addEventListener("change", markTyped);
main.addEventListener("reset", (event) => typed.delete(event.target));
main.addEventListener("submit", (event) => typed.delete(event.target), true);
const typedForms = () =>
  [...main.querySelectorAll("form[id]")].filter(
    (form) =>
      !form.matches(SEARCH) && (typed.has(form) || form.querySelector(".field-error:not(:empty)")),
  );

// A form's state: its markup without what submitting adds (errors, a disabled button)
// and its controls' values. Taken when the operator first focuses a control, before
// typing: what the form showed as drawn.
function formState(form) {
  const copy = form.cloneNode(true);
  for (const error of copy.querySelectorAll(".field-error")) error.remove();
  for (const el of [copy, ...copy.querySelectorAll("*")]) {
    for (const name of ["aria-invalid", "aria-describedby", "disabled"]) el.removeAttribute(name);
  }
  const values = [...form.elements].map((el) => [el.id || el.name, el.value, el.checked]);
  return copy.outerHTML + JSON.stringify(values);
}
const asDrawn = new WeakMap();
main.addEventListener("focusin", (event) => {
  const form = event.target.closest?.("form");
  if (form && !asDrawn.has(form)) asDrawn.set(form, formState(form));
});

const changed = h(
  "p",
  { id: "data-changed", class: "banner", role: "status", hidden: true },
  "Data changed since you began typing: the form keeps your unsaved input as it was drawn. ",
  h(
    "button",
    {
      type: "button",
      id: "data-changed-reload",
      onclick: () => route({ focus: false }),
    },
    "Reload (discards what you typed)",
  ),
);
main.before(changed);

// While the control plane does not answer: the view greyed, a banner and each panel
// saying how old what it shows is, the header's version marked unknown. Cleared by the
// first answer (connection.js); the view's next refresh redraws it from fresh data.
const stale = h("p", { id: "stale", class: "banner bad", role: "status", hidden: true });
main.before(stale);
let staleTimer = null;
const secondsAgo = () => Math.max(0, Math.round((Date.now() - (drawnAt ?? Date.now())) / 1000));
function showStale() {
  const down = isDown();
  stale.hidden = !down;
  main.classList.toggle("unreachable", down);
  document.getElementById("version").classList.toggle("unreachable", down);
  for (const note of main.querySelectorAll(".stale-note")) if (!down) note.remove();
  if (!down) return;
  const ago = drawnAt === null ? null : secondsAgo();
  stale.textContent =
    ago === null
      ? "Cannot reach the control plane. Retrying every 2 seconds…"
      : `Cannot reach the control plane: what this page shows was last updated ${ago} s ago ` +
        `(${new Date(drawnAt).toLocaleTimeString()}) and may be out of date. ` +
        "Retrying every 2 seconds…";
  for (const card of main.querySelectorAll("section.card")) {
    let note = card.querySelector(":scope > .stale-note");
    if (!note) {
      note = h("p", { class: "stale-note" });
      card.querySelector(":scope > h2")?.after(note);
    }
    note.textContent = ago === null ? "Not updated" : `Last updated ${ago} s ago`;
  }
}
// A view refreshing less often than RETRY_MS learns of an outage from this probe.
setInterval(() => {
  if (session.role) api("GET", "/healthz").catch(() => {});
}, RETRY_MS);
onConnectionChange((down) => {
  clearInterval(staleTimer);
  if (down) staleTimer = setInterval(showStale, 1000);
  showStale();
  current?.onConnection?.(down);
  // Back: redraw from fresh data now, not at the view's next tick.
  if (!down) retryNow();
});

// One refresh of the view that keeps what the operator typed.
async function refreshKeepingInput(view) {
  const kept = typedForms().map((form) => ({ form, drawn: asDrawn.get(form) }));
  try {
    await view.refresh();
  } finally {
    // Also when the refresh failed half way: what was typed is put back.
    for (const { form, drawn } of kept) {
      if (form.isConnected) continue; // not redrawn
      const fresh = main.querySelector(`form#${CSS.escape(form.id)}`);
      if (!fresh) continue; // the view closed it
      if (formState(fresh) !== drawn) changed.hidden = false;
      fresh.replaceWith(form);
    }
    if (!typedForms().length) changed.hidden = true;
  }
}

function showRole() {
  const role = document.getElementById("role");
  role.hidden = !session.role;
  role.textContent = session.role === "admin" ? "admin" : "read-only";
  document.getElementById("readonly").hidden = session.role !== "viewer";
  document.getElementById("sign-out").hidden = !session.role;
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

// The view's refreshes, one after another: every `interval` ms, every RETRY_MS while the
// control plane does not answer. An outage is said by the banner, not by a toast a tick.
function scheduleRefresh(view, mine, delay = null) {
  timer = setTimeout(
    async () => {
      if (mine !== generation) return;
      try {
        await refreshKeepingInput(view);
        // A view may draw what it could of a failed round (a part it retries itself).
        if (!isDown()) drawnAt = Date.now();
      } catch (error) {
        if (!isOutage(error)) toast(error.message, "error");
      }
      if (mine !== generation) return;
      showStale();
      showVersion();
      scheduleRefresh(view, mine);
    },
    delay ?? (isDown() ? Math.min(RETRY_MS, view.interval || 5000) : view.interval || 5000),
  );
}

// The view's next refresh (or, if it could not be drawn, its drawing) at once.
function retryNow() {
  if (current?.refresh) {
    clearTimeout(timer);
    scheduleRefresh(current, generation, 0);
  } else if (main.querySelector("#view-retry")) {
    clearTimeout(timer);
    route({ focus: false });
  }
}

async function route({ focus = true } = {}) {
  const mine = ++generation;
  clearTimeout(timer);
  changed.hidden = true;
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
    // Not when the operator is already working in the view (it drew its first parts
    // while the rest loaded): a click there must keep its focus.
    if (focus && !main.contains(document.activeElement)) {
      const title = main.querySelector(".view-title");
      if (title) {
        title.tabIndex = -1;
        title.focus();
      }
    }
    drawnAt = Date.now();
    showStale();
    if (current.refresh) scheduleRefresh(current, mine);
    showVersion();
  } catch (error) {
    if (mine !== generation) return;
    const outage = isOutage(error);
    main.replaceChildren(
      h("h2", { class: "view-title" }, TITLES[r.view] || "Error"),
      h("p", { class: "field-error", role: "alert", id: "view-error" }, error.message),
      outage ? h("p", { class: "hint", id: "view-retry" }, "Trying again every 2 seconds…") : null,
    );
    drawnAt = null;
    showStale();
    // A view that could not be drawn because the server did not answer draws itself
    // once it does, without a reload (and keeps the error until then).
    if (outage) timer = setTimeout(() => mine === generation && route({ focus: false }), RETRY_MS);
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
document.getElementById("sign-out").addEventListener("click", () => {
  signOut();
  document.getElementById("token").value = "";
  showRole();
  toast("Signed out: this browser no longer holds the token.");
  route();
  document.getElementById("token").focus();
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
