// Hash routes: #/view, #/view/arg, #/view?key=value. Deep links work on reload.

import { h } from "./dom.js";

export function parseHash(hash = location.hash) {
  const raw = hash.replace(/^#\/?/, "");
  const [path, query = ""] = raw.split("?");
  const [view, ...rest] = path.split("/");
  return {
    view: view || "overview",
    arg: rest.length ? decodeURIComponent(rest.join("/")) : null,
    params: new URLSearchParams(query),
  };
}

export function link(view, arg = null, params = null) {
  let hash = `#/${view}`;
  if (arg !== null) hash += `/${encodeURIComponent(arg)}`;
  const query = params ? new URLSearchParams(params).toString() : "";
  return query ? `${hash}?${query}` : hash;
}

// A link to a user's page, its id cut to one line with an ellipsis where it is long (a
// 300-character id); the whole id in its title and, on keyboard focus, wrapped in full.
export const userLink = (user, attrs = {}) =>
  h("a", { href: link("users", user), class: "user-name", title: user, ...attrs }, user);

// Change the query of the current view without a new history entry per keystroke.
export function replaceParams(view, arg, params) {
  const target = link(
    view,
    arg,
    Object.fromEntries(Object.entries(params).filter(([, v]) => v !== "" && v != null)),
  );
  history.replaceState(null, "", target);
}
