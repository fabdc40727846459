// How the lines are told apart: a colour per user (Tableau 10), stable while the page is
// open, and with it a dash pattern per line, so that they differ in grey too.

const PALETTE = [
  "#4e79a7",
  "#f28e2b",
  "#e15759",
  "#76b7b2",
  "#59a14f",
  "#edc948",
  "#b07aa1",
  "#ff9da7",
  "#9c755f",
  "#79706e",
];
// A user with no reported usage has no colour assigned yet: its line takes the first.
export const FIRST_COLOUR = PALETTE[0];
// The limit in force and the marks of its changes on one user's chart.
export const LIMIT_COLOUR = "#6b7280";
// Dash patterns in CSS px.
const DASHES = [[], [10, 4], [2, 3], [12, 3, 2, 3], [5, 5], [2, 7], [8, 2, 2, 2, 2, 2], [16, 6]];
const assigned = new Map();

function hash(text) {
  let x = 2166136261;
  for (let i = 0; i < text.length; i++) x = Math.imul(x ^ text.charCodeAt(i), 16777619) >>> 0;
  return x;
}

// Stable: the same user keeps its colour across refreshes; no two shown users share one.
export function colours(users) {
  const used = new Set();
  const result = {};
  for (const user of users) {
    let c = assigned.get(user);
    if (c === undefined || used.has(c)) {
      c = hash(user) % PALETTE.length;
      while (used.has(c) && used.size < PALETTE.length) c = (c + 1) % PALETTE.length;
      assigned.set(user, c);
    }
    used.add(c);
    result[user] = PALETTE[c];
  }
  return result;
}

// The users' dash patterns, by their place in the list.
export const dashes = (users) =>
  Object.fromEntries(users.map((u, i) => [u, DASHES[i % DASHES.length]]));
