// Whether the control plane answers. api.js reports each request's fate here; the shell
// (app.js) greys the view and says since when its data is stale while it does not, and
// every view retries on its own until it answers again.

const listeners = new Set();
let down = false;

// An answer came (any HTTP status from the control plane itself).
export function reached() {
  if (!down) return;
  down = false;
  for (const listener of listeners) listener(false);
}

// No answer: the request failed in the network, or a proxy said the server is gone.
export function unreachable() {
  if (down) return;
  down = true;
  for (const listener of listeners) listener(true);
}

export const isDown = () => down;

// listener(down): called when the control plane stops or starts answering.
export function onConnectionChange(listener) {
  listeners.add(listener);
}

// An error the control plane did not answer with (the page should wait and retry).
export const isOutage = (error) => error?.status === 0 || [502, 503, 504].includes(error?.status);
