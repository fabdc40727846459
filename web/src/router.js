// Hash routes: #/view, #/view/arg, #/view?key=value. Deep links work on reload.

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

// Change the query of the current view without a new history entry per keystroke.
export function replaceParams(view, arg, params) {
  const target = link(
    view,
    arg,
    Object.fromEntries(Object.entries(params).filter(([, v]) => v !== "" && v != null)),
  );
  history.replaceState(null, "", target);
}
