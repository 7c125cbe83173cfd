// What both pages share: calls to the server with the API key, the dialog that asks for the
// key, and number formatting. Plain script (no modules, no build): it defines `Tandem`.
"use strict";

const Tandem = (() => {
  const KEY_STORAGE = "tandem.apiKey";

  function storedKey() {
    try {
      return localStorage.getItem(KEY_STORAGE) || "";
    } catch {
      return ""; // storage disabled: the key lives as long as the page
    }
  }

  let memoryKey = storedKey();

  function apiKey() {
    return memoryKey;
  }

  function setApiKey(key) {
    memoryKey = key;
    try {
      if (key) localStorage.setItem(KEY_STORAGE, key);
      else localStorage.removeItem(KEY_STORAGE);
    } catch {
      /* kept in memory only */
    }
    document.dispatchEvent(new CustomEvent("tandem-key-changed"));
  }

  // An error the server answered: its status and its message.
  class ApiError extends Error {
    constructor(message, status) {
      super(message);
      this.name = "ApiError";
      this.status = status;
    }
  }

  // The message of an error answer: every API of the server puts it in `error.message` (some
  // as `detail`); else the status line.
  async function errorMessage(response) {
    let text = "";
    try {
      text = await response.text();
      const body = JSON.parse(text);
      const error = body && body.error;
      if (error && typeof error.message === "string") return error.message;
      if (typeof error === "string") return error;
      if (body && typeof body.detail === "string") return body.detail;
    } catch {
      /* not JSON */
    }
    const status = `${response.status} ${response.statusText || ""}`.trim();
    return text && text.length < 300 ? `${status}: ${text}` : status;
  }

  // ------------------------------------------------------------------ the key dialog
  let dialog = null; // {root, input, error, note}
  let waiters = []; // {resolve, reject, signal, onAbort}

  function buildDialog() {
    const root = el("div", { class: "modal-backdrop", "data-testid": "api-key-dialog", hidden: "" });
    const card = el("form", { class: "modal", role: "dialog", "aria-modal": "true",
                              "aria-labelledby": "api-key-title" });
    const title = el("h2", { id: "api-key-title" }, "API key required");
    const note = el("p", { class: "muted" });
    const label = el("label", { class: "field" });
    label.append(el("span", {}, "API key"));
    const input = el("input", {
      type: "password", autocomplete: "off", spellcheck: "false", required: "",
      placeholder: "the server's --api-key", "data-testid": "api-key-input",
    });
    label.append(input);
    const error = el("p", { class: "form-error", "data-testid": "api-key-error", hidden: "" });
    const actions = el("div", { class: "modal-actions" });
    const forget = el("button", { type: "button", class: "btn ghost forget", "data-testid": "api-key-forget" },
                      "Forget the key");
    forget.addEventListener("click", () => {
      setApiKey("");
      closeDialog();
      settle((w) => w.reject(new ApiError("The API key was forgotten.", 401)));
    });
    actions.append(forget);
    const cancel = el("button", { type: "button", class: "btn ghost", "data-testid": "api-key-cancel" },
                      "Cancel");
    const submit = el("button", { type: "submit", class: "btn primary", "data-testid": "api-key-submit" },
                      "Use key");
    actions.append(cancel, submit);
    card.append(title, note, label, error, actions);
    root.append(card);
    document.body.append(root);
    card.addEventListener("submit", (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) return;
      setApiKey(key);
      closeDialog();
      settle((w) => w.resolve(key));
    });
    cancel.addEventListener("click", () => {
      closeDialog();
      settle((w) => w.reject(new ApiError("An API key is needed to use this server.", 401)));
    });
    root.addEventListener("keydown", (event) => {
      if (event.key === "Escape") cancel.click();
    });
    return { root, input, error, note, forget };
  }

  function settle(how) {
    const pending = waiters;
    waiters = [];
    for (const w of pending) {
      if (w.signal) w.signal.removeEventListener("abort", w.onAbort);
      how(w);
    }
  }

  function closeDialog() {
    if (dialog) dialog.root.hidden = true;
  }

  // Shows the dialog (once, however many calls wait) and resolves with the key entered.
  // `refusal`: the server's message when it refused the key it was sent.
  function askForKey(refusal, signal) {
    if (!dialog) dialog = buildDialog();
    dialog.note.textContent =
      "This server needs an API key. It is kept in this browser (localStorage) and sent " +
      "with every request as Authorization: Bearer.";
    if (refusal) {
      dialog.error.textContent = `The server refused this key: ${refusal}`;
      dialog.error.hidden = false;
    } else if (!waiters.length) {
      dialog.error.hidden = true;
    }
    dialog.forget.hidden = !apiKey();
    const wasHidden = dialog.root.hidden;
    dialog.root.hidden = false;
    if (wasHidden || refusal) {
      dialog.input.value = "";
      dialog.input.focus();
    }
    return new Promise((resolve, reject) => {
      const waiter = { resolve, reject, signal };
      if (signal) {
        if (signal.aborted) return reject(new DOMException("Aborted", "AbortError"));
        waiter.onAbort = () => {
          waiters = waiters.filter((w) => w !== waiter);
          if (!waiters.length) closeDialog();
          reject(new DOMException("Aborted", "AbortError"));
        };
        signal.addEventListener("abort", waiter.onAbort);
      }
      waiters.push(waiter);
    });
  }

  // A button in the top bar, while a key is stored: to change or forget it.
  function keyButton() {
    const nav = document.querySelector(".nav");
    if (!nav) return;
    const button = el("button", { type: "button", class: "btn small ghost", "data-testid": "api-key-button",
                                  title: "Change or forget the API key kept in this browser" }, "API key");
    button.addEventListener("click", () => askForKey(null).catch(() => {}));
    nav.prepend(button);
    const update = () => { button.hidden = !apiKey(); };
    document.addEventListener("tandem-key-changed", update);
    update();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", keyButton);
  else keyButton();

  // fetch() with the key; a 401 asks for the key (saying why if a key was refused) and tries
  // again with the new one. The body must be resendable (a string), as every caller's is.
  async function api(url, init = {}) {
    for (;;) {
      const key = apiKey();
      const headers = new Headers(init.headers || {});
      if (key) headers.set("Authorization", `Bearer ${key}`);
      const response = await fetch(url, { ...init, headers });
      if (response.status !== 401) return response;
      const message = await errorMessage(response);
      await askForKey(key ? message : null, init.signal);
    }
  }

  // fetch JSON; a non-2xx answer throws an ApiError with the server's message.
  async function getJSON(url, init = {}) {
    const response = await api(url, init);
    if (!response.ok) throw new ApiError(await errorMessage(response), response.status);
    return response.json();
  }

  // ------------------------------------------------------------------ DOM and numbers
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value === false || value === null || value === undefined) continue;
      node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children) node.append(child); // strings become text nodes
    return node;
  }

  const integer = new Intl.NumberFormat(undefined, { maximumFractionDigits: 0 });

  function formatInt(n) {
    return Number.isFinite(n) ? integer.format(n) : "—";
  }

  function formatRate(n) {
    if (!Number.isFinite(n)) return "—";
    return n >= 100 ? integer.format(n) : n.toFixed(n >= 10 ? 1 : 2);
  }

  function formatSeconds(s) {
    if (!Number.isFinite(s)) return "—";
    if (s < 1e-3) return `${(s * 1e6).toFixed(0)} µs`;
    if (s < 1) return `${(s * 1e3).toFixed(s < 0.01 ? 2 : 1)} ms`;
    return `${s.toFixed(2)} s`;
  }

  function formatPercent(f) {
    return Number.isFinite(f) ? `${(f * 100).toFixed(1)}%` : "—";
  }

  return {
    api, getJSON, errorMessage, askForKey, apiKey, setApiKey, ApiError,
    el, formatInt, formatRate, formatSeconds, formatPercent,
  };
})();
