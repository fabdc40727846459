// The REST API of the control plane that serves this page. Errors become ApiError
// with the field the server named and a message in plain words.

import { plural } from "./dom.js";

const TOKEN_KEY = "output-rate-token";

export const getToken = () => localStorage.getItem(TOKEN_KEY) || "";
export const setToken = (token) => localStorage.setItem(TOKEN_KEY, token);

export class ApiError extends Error {
  constructor(status, message, field = null) {
    super(message);
    this.status = status;
    this.field = field;
  }
}

// "line 3: tier: unknown tier 'x'" -> "Line 3: Tier: unknown tier 'x'" (a CSV body's errors).
function lineMessage(error) {
  const reason = error.msg.replace(/^line \d+: [^:]+: /, "");
  const what = error.field === "items" ? "" : `${FIELD_WORDS[error.field] || error.field}: `;
  return `Line ${error.line}: ${what}${reason}`;
}

const FIELD_WORDS = {
  output_tokens_per_second: "Rate",
  tier: "Tier",
  description: "Description",
  name: "Name",
  user: "User id",
  scope: "Scope",
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
    return [...errors.map(lineMessage), ...(more ? [`and ${more[1]} more`] : [])].join("\n");
  }
  if (first) {
    const what = FIELD_WORDS[first.field] || first.field;
    if (first.field === "output_tokens_per_second" || /rate/.test(first.field)) {
      return `${what}: enter a whole number of tokens per second from 1 to 1,000,000.`;
    }
    if (first.type === "string_pattern_mismatch")
      return `${what}: contains characters that are not allowed.`;
    if (first.type === "string_too_long") return `${what}: too long.`;
    return `${what}: ${first.msg.replace(/^Value error, /, "")}.`;
  }
  if (detail) {
    // "tier: unknown tier 'x'" -> "Tier: unknown tier 'x'"
    const m = detail.match(/^([a-z_.0-9]+): (.*)$/);
    if (m) return `${FIELD_WORDS[m[1]] || m[1]}: ${m[2]}`;
    return detail.charAt(0).toUpperCase() + detail.slice(1);
  }
  return `The request failed (HTTP ${status}).`;
}

export async function api(method, path, body, { contentType = "application/json" } = {}) {
  const headers = { Authorization: `Bearer ${getToken()}` };
  if (body !== undefined) headers["Content-Type"] = contentType;
  let response;
  try {
    response = await fetch(path, {
      method,
      headers,
      // A JSON body is encoded here; any other (text/csv) is sent as given.
      body: body === undefined || !/json/.test(contentType) ? body : JSON.stringify(body),
    });
  } catch (_) {
    throw new ApiError(0, "The control plane could not be reached. Is it running?");
  }
  if (!response.ok) {
    let data = null;
    try {
      data = await response.json();
    } catch (_) {
      /* not JSON */
    }
    // Whole seconds (RFC 9110 also allows a date, which this server does not send).
    const retryAfterS = Number.parseInt(response.headers.get("Retry-After") || "", 10) || null;
    throw new ApiError(
      response.status,
      plainMessage(response.status, data, retryAfterS),
      data?.field,
    );
  }
  return response.status === 204 ? null : response.json();
}

// Only the fields sent change (RFC 7396).
export const mergePatch = (path, changes) =>
  api("PATCH", path, changes, { contentType: "application/merge-patch+json" });

export const userPath = (user) => `/limits/${encodeURIComponent(user)}`;
export const tierPath = (name) => `/tiers/${encodeURIComponent(name)}`;
