// The REST API of the control plane that serves this page. Errors become ApiError
// with the field the server named and a message in plain words. Whether the control
// plane answers at all is reported to connection.js (every view goes stale without it).
// Writes of a user, a tier or the default carry the If-Match of the record as read
// (docs/control-plane.md, "Versioned writes"): a 412 is a ConflictError.

import { reached, unreachable } from "./connection.js";
import { plural } from "./dom.js";

const TOKEN_KEY = "output-rate-token";

export const getToken = () => localStorage.getItem(TOKEN_KEY) || "";
export const setToken = (token) => localStorage.setItem(TOKEN_KEY, token);
export const forgetToken = () => localStorage.removeItem(TOKEN_KEY);

export class ApiError extends Error {
  constructor(status, message, field = null) {
    super(message);
    this.status = status;
    this.field = field;
  }
}

// 412: the record changed since it was read (its If-Match is stale); nothing was written.
// currentVersion: the record's version now (null: it no longer exists).
export class ConflictError extends ApiError {
  constructor(message, currentVersion) {
    super(412, message, null);
    this.currentVersion = currentVersion;
  }
}

const capital = (text) => text.charAt(0).toUpperCase() + text.slice(1);

// "line 3: output_tokens_per_second: rate must be at least 1" -> "Line 3: Rate must be at
// least 1" (the server says the field and its rule in words: control_plane/errors.py);
// "line 9: tier: unknown tier 'x'" -> "Line 9: Tier: unknown tier 'x'".
function lineMessage(error) {
  const reason = error.msg.replace(/^line \d+: [^:]+: /, "");
  const what = FIELD_WORDS[error.field] || error.field;
  const named = error.field === "items" || reason.startsWith(`${what.toLowerCase()} `);
  return `Line ${error.line}: ${named ? capital(reason) : `${what}: ${reason}`}`;
}

// Over many bad lines, one line first saying which: "30 lines have errors: 3, 7, 12, …".
// numMore: errors the server counted but did not list.
const SHOWN_LINE_NUMBERS = 12;
function linesSummary(errors, numMore) {
  const lines = [...new Set(errors.map((e) => e.line))];
  const shown = lines.slice(0, SHOWN_LINE_NUMBERS).join(", ");
  const rest = lines.length > SHOWN_LINE_NUMBERS || numMore ? ", …" : "";
  const count = numMore
    ? `${plural(errors.length + numMore, "error")} on ${lines.length}+ lines`
    : `${plural(lines.length, "line")} ${lines.length === 1 ? "has" : "have"} errors`;
  return `${count}: ${shown}${rest}`;
}

const FIELD_WORDS = {
  output_tokens_per_second: "Rate",
  tier: "Tier",
  description: "Description",
  name: "Name",
  user: "User id",
  scope: "Scope",
  ceiling_output_tokens_per_second: "Ceiling",
  target: "Target",
  target_kind: "Kind",
};

// The server's messages name fields and pydantic's rules; say the same in plain words.
// retryAfterS: the Retry-After of a 429, said as when to try again.
export function plainMessage(status, data, retryAfterS = null) {
  const detail = data && typeof data.detail === "string" ? data.detail : "";
  if (status === 429) {
    const why = detail
      ? `${detail.charAt(0).toUpperCase()}${detail.slice(1)}.`
      : "Too many requests.";
    return retryAfterS ? `${why} Try again in ${plural(retryAfterS, "second")}.` : why;
  }
  if (status === 401) return "The token was not accepted. Enter the admin token or a viewer token.";
  if (status === 403)
    return "This session is read-only (viewer token): the control plane refused the change.";
  if (status >= 500)
    return (
      `The control plane failed (HTTP ${status}). ` +
      "Try again; if it keeps failing, check its log."
    );
  const errors = data?.errors || [];
  const first = errors[0];
  // Every bad line of a text body, one per line of the message.
  if (first?.line) {
    const more = detail.match(/; and ([0-9]+) more errors$/);
    const numMore = more ? Number(more[1]) : 0;
    return [
      ...(errors.length > 1 || numMore ? [linesSummary(errors, numMore)] : []),
      ...errors.map(lineMessage),
      ...(numMore ? [`and ${numMore} more`] : []),
    ].join("\n");
  }
  if (first) {
    const what = FIELD_WORDS[first.field] || first.field;
    if (first.field === "output_tokens_per_second" || /rate/.test(first.field)) {
      return `${what}: enter a whole number of tokens per second from 1 to 1,000,000.`;
    }
    // The server says the field and its rule ("user id may not contain '/', ...").
    return `${capital(first.msg.replace(/^Value error, /, ""))}.`;
  }
  if (detail) {
    // "tier: unknown tier 'x'" -> "Tier: unknown tier 'x'"
    const m = detail.match(/^([a-z_.0-9]+): (.*)$/);
    if (m) return `${FIELD_WORDS[m[1]] || m[1]}: ${m[2]}`;
    return detail.charAt(0).toUpperCase() + detail.slice(1);
  }
  return `The request failed (HTTP ${status}).`;
}

// A request and its answer: {data, etag}. ifMatch: the ETag the record was read with
// (a write of it is refused with a ConflictError if the record changed since).
export async function request(
  method,
  path,
  body,
  { contentType = "application/json", ifMatch = null } = {},
) {
  const headers = { Authorization: `Bearer ${getToken()}` };
  if (body !== undefined) headers["Content-Type"] = contentType;
  if (ifMatch) headers["If-Match"] = ifMatch;
  let response;
  try {
    response = await fetch(path, {
      method,
      headers,
      // The answers change under the page: never a cached one.
      cache: "no-store",
      // A JSON body is encoded here; any other (text/csv) is sent as given.
      body: body === undefined || !/json/.test(contentType) ? body : JSON.stringify(body),
    });
  } catch (_) {
    unreachable();
    throw new ApiError(0, "The control plane could not be reached. Is it running?");
  }
  // A proxy in front of a stopped control plane answers 502-504 itself.
  if ([502, 503, 504].includes(response.status)) unreachable();
  else reached();
  if (!response.ok) {
    let data = null;
    try {
      data = await response.json();
    } catch (_) {
      /* not JSON */
    }
    if (response.status === 412)
      throw new ConflictError(
        "Changed by someone else since you opened it: nothing was saved.",
        data?.current_version ?? null,
      );
    // Whole seconds (RFC 9110 also allows a date, which this server does not send).
    const retryAfterS = Number.parseInt(response.headers.get("Retry-After") || "", 10) || null;
    throw new ApiError(
      response.status,
      plainMessage(response.status, data, retryAfterS),
      data?.field,
    );
  }
  const data = response.status === 204 ? null : await response.json();
  return { data, etag: response.headers.get("ETag") };
}

export async function api(method, path, body, options = {}) {
  return (await request(method, path, body, options)).data;
}

// Only the fields sent change (RFC 7396).
export const mergePatch = (path, changes, { ifMatch = null } = {}) =>
  api("PATCH", path, changes, { contentType: "application/merge-patch+json", ifMatch });

export const userPath = (user) => `/limits/${encodeURIComponent(user)}`;
export const tierPath = (name) => `/tiers/${encodeURIComponent(name)}`;
