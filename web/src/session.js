// Who this browser is: the admin (may write), a viewer (read-only) or nobody yet.

import { api, forgetToken, getToken } from "./api.js";

export const session = { role: null, name: null };

export async function detectRole() {
  session.role = null;
  if (!getToken()) return null;
  try {
    const me = await api("GET", "/session");
    session.role = me.can_write ? "admin" : "viewer";
    session.name = me.name;
  } catch (error) {
    if (error.status !== 401) throw error;
  }
  return session.role;
}

// Signing out: this browser forgets the token (nothing is sent to the server: a token
// stays valid until revoked there).
export function signOut() {
  forgetToken();
  session.role = null;
  session.name = null;
}

export const canWrite = () => session.role === "admin";
