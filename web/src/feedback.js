// Success messages, errors next to the field, and confirmations that state the effect.

import { h } from "./dom.js";

let toastTimer = null;

export function toast(message, kind = "ok") {
  const el = document.getElementById("toast");
  el.replaceChildren(h("p", { class: `toast ${kind}` }, message));
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => el.replaceChildren(), 6000);
}

// Put `message` under the control for `field` in `form` (or at the form's top).
export function fieldError(form, field, message) {
  const control = (field && form.querySelector(`[data-field="${field}"]`)) || null;
  const anchor = control ? control.closest(".field") || control : form;
  const id = `${form.id || "form"}-${field || "form"}-error`;
  const note = h("p", { class: "field-error", id, role: "alert" }, message);
  if (control) {
    anchor.append(note);
    const input = control.matches("input,select,textarea")
      ? control
      : control.querySelector("input[type=text], input:not([type]), select, textarea") ||
        control.querySelector("input");
    if (input) {
      input.setAttribute("aria-invalid", "true");
      input.setAttribute("aria-describedby", id);
      input.focus();
    }
  } else {
    form.prepend(note);
  }
}

export function clearErrors(form) {
  for (const el of form.querySelectorAll(".field-error")) el.remove();
  for (const el of form.querySelectorAll("[aria-invalid]")) {
    el.removeAttribute("aria-invalid");
    el.removeAttribute("aria-describedby");
  }
}

// Submit handler: validation or API errors land next to their field; success is toasted.
export function handleSubmit(form, action) {
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors(form);
    const button = form.querySelector("button[type=submit]");
    if (button) button.disabled = true;
    let done = false;
    try {
      const message = await action();
      if (message) toast(message);
      done = true;
    } catch (error) {
      fieldError(form, error.field || null, error.message);
    } finally {
      if (button) button.disabled = false;
    }
    if (done) keepFocus(form);
  });
}

// After a save the view may have redrawn the form (and a confirmation closed): focus goes
// back to the (redrawn) form's submit button, where the operator was, not to the page.
function keepFocus(form) {
  const active = document.activeElement;
  if (active && active !== document.body && active.isConnected) return;
  const now = (form.id && document.getElementById(form.id)) || (form.isConnected ? form : null);
  now?.querySelector("button[type=submit]")?.focus();
}

export class FieldError extends Error {
  constructor(field, message) {
    super(message);
    this.field = field;
  }
}

// A modal that states what will happen; resolves true only on the confirm button.
// A line is text or a node (a list of the users a change affects: web/src/preview.js).
export function confirmEffect(title, lines, confirmLabel) {
  const dialog = document.getElementById("confirm");
  dialog.classList.toggle(
    "wide",
    lines.some((l) => l instanceof Node),
  );
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-lines").replaceChildren(...lines.map((l) => h("li", {}, l)));
  const ok = document.getElementById("confirm-ok");
  ok.textContent = confirmLabel;
  dialog.returnValue = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.showModal();
    document.getElementById("confirm-cancel").focus();
  });
}
