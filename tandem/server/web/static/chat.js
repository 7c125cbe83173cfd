// The chat page: a conversation with the served model through POST /v1/chat/completions,
// streamed (OpenAI's server-sent events, read from fetch's body stream). Model and user text
// only ever reach the page as text nodes.
"use strict";

(() => {
  const { el } = Tandem;
  const $ = (selector) => document.querySelector(selector);

  const SAMPLING_FIELDS = [
    // [request field, input id, integer?]
    ["temperature", "temperature", false],
    ["top_p", "top_p", false],
    ["top_k", "top_k", true],
    ["min_p", "min_p", false],
    ["max_tokens", "max_tokens", true],
    ["seed", "seed", true],
    ["repetition_penalty", "repetition_penalty", false],
    ["thinking_token_budget", "thinking_token_budget", true],
  ];

  const ui = {
    messages: $('[data-testid="messages"]'),
    empty: $('[data-testid="empty-state"]'),
    form: $('[data-testid="composer"]'),
    input: $("#input"),
    send: $('[data-testid="send"]'),
    stop: $('[data-testid="stop"]'),
    note: $('[data-testid="composer-note"]'),
    system: $("#system-prompt"),
    extra: $("#extra-body"),
    extraError: $('[data-testid="extra-body-error"]'),
    thinking: $("#thinking"),
  };

  const state = {
    settings: null, // GET /chat/settings
    history: [], // the conversation sent with the next message (answers, not thinking)
    reply: null, // the reply streaming now: {controller, stopped}
    conversation: 0, // counts "new chat"s: a reply ending after one stays out of the new one
  };

  // ------------------------------------------------------------------ settings
  async function loadSettings() {
    try {
      const settings = await Tandem.getJSON("/chat/settings");
      state.settings = settings;
      $('[data-testid="model-name"]').textContent = settings.model;
      $('[data-testid="model-chip"]').title = `${settings.model}: ${settings.max_model_len} tokens of context`;
      $('[data-testid="context-length"]').textContent =
        `${Tandem.formatInt(settings.max_model_len)} ctx`;
      $(".empty-model").textContent = settings.model;
      document.title = `${settings.model} · Tandem`;
      for (const node of document.querySelectorAll(".reasoning-only")) {
        node.hidden = !settings.reasoning;
      }
      const cap = settings.max_tokens ?? settings.max_model_len;
      $("#max_tokens").max = String(cap);
      $('[data-testid="sampling-source"]').textContent =
        `Defaults: ${settings.sampling_source}.` +
        (settings.max_tokens ? ` The server caps answers at ${settings.max_tokens} tokens.` : "");
      resetSampling();
      setNote("");
    } catch (error) {
      setNote(`Could not read the chat settings: ${error.message}`, true);
      $('[data-testid="model-name"]').textContent = "unavailable";
    }
  }

  function resetSampling() {
    const settings = state.settings;
    if (!settings) return;
    const sampling = settings.sampling || {};
    for (const [field, id] of SAMPLING_FIELDS) {
      const input = document.getElementById(id);
      const value = field === "max_tokens" ? settings.max_tokens : sampling[field];
      input.value = value === undefined || value === null ? "" : String(value);
    }
  }

  // Every control's value (an empty one is left to the server), the thinking switch and the
  // extra fields. Throws on a value that is not a number or on bad JSON.
  function requestFields() {
    const fields = {};
    for (const [field, id, integer] of SAMPLING_FIELDS) {
      const input = document.getElementById(id);
      if (input.closest("[hidden]")) continue;
      const text = input.value.trim();
      if (!text) continue;
      const value = Number(text);
      if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
        throw new Error(`${input.closest("label").querySelector("span").textContent} must be ` +
                        `${integer ? "a whole number" : "a number"}, not "${text}"`);
      }
      fields[field] = value;
    }
    if (state.settings?.reasoning && !ui.thinking.checked) {
      fields.chat_template_kwargs = { enable_thinking: false };
    }
    const extraText = ui.extra.value.trim();
    ui.extraError.hidden = true;
    if (extraText) {
      let extra;
      try {
        extra = JSON.parse(extraText);
      } catch (error) {
        ui.extraError.textContent = `Not valid JSON: ${error.message}`;
        ui.extraError.hidden = false;
        throw new Error("The extra request fields are not valid JSON (see Advanced).");
      }
      if (!extra || typeof extra !== "object" || Array.isArray(extra)) {
        throw new Error("The extra request fields must be a JSON object.");
      }
      Object.assign(fields, extra);
    }
    return fields;
  }

  // ------------------------------------------------------------------ messages
  function setNote(text, isError = false) {
    ui.note.textContent = text;
    ui.note.classList.toggle("form-error", isError && !!text);
    ui.note.classList.toggle("muted", !isError);
  }

  function scrolledToBottom() {
    const m = ui.messages;
    return m.scrollHeight - m.scrollTop - m.clientHeight < 40;
  }

  function follow(wasAtBottom) {
    if (wasAtBottom) ui.messages.scrollTop = ui.messages.scrollHeight;
  }

  function addUserMessage(text) {
    ui.empty.hidden = true;
    const node = el("div", { class: "message user", "data-testid": "message-user" },
                    el("div", { class: "bubble", "data-testid": "user-text" }, text));
    ui.messages.append(node);
    return node;
  }

  // An assistant message: thinking (folded, made on its first token), answer, a line with its
  // state, its figures and a copy button.
  function addAssistantMessage() {
    const answer = el("div", { class: "answer", "data-testid": "answer" });
    const body = el("div", { class: "body" }, answer);
    const status = el("span", { class: "status", "data-testid": "status" });
    const figures = el("span", { class: "figures", "data-testid": "figures" });
    const copy = el("button", { class: "btn small ghost", type: "button", "data-testid": "copy",
                                title: "Copy the answer", hidden: true },
                    copyIcon(), el("span", { class: "copy-label" }, "Copy"));
    const meta = el("div", { class: "meta" }, copy, status, figures);
    const node = el("div", { class: "message assistant", "data-testid": "message-assistant",
                             "data-state": "waiting" },
                    el("div", { class: "role" }, state.settings?.model || "Assistant"), body, meta);
    ui.messages.append(node);
    const message = {
      node, body, answer, status, figures, copy,
      text: "", reasoning: "", reasoningNode: null, reasoningText: null,
      answerText: answer.appendChild(document.createTextNode("")),
    };
    copy.addEventListener("click", () => copyText(message.text, copy));
    return message;
  }

  function appendReasoning(message, text) {
    if (!message.reasoningNode) {
      message.reasoningText = el("div", { class: "reasoning-text", "data-testid": "reasoning-text" });
      message.reasoningSummary = el("summary", {}, "Thinking…");
      message.reasoningNode = el("details", { class: "reasoning", "data-testid": "reasoning" },
                                 message.reasoningSummary, message.reasoningText);
      message.reasoningTextNode = message.reasoningText.appendChild(document.createTextNode(""));
      message.body.insertBefore(message.reasoningNode, message.answer);
      message.reasoningStart = performance.now();
    }
    message.reasoning += text;
    message.reasoningTextNode.appendData(text);
  }

  function endReasoning(message) {
    if (message.reasoningNode && !message.reasoningEnd) {
      message.reasoningEnd = performance.now();
      const seconds = (message.reasoningEnd - message.reasoningStart) / 1000;
      message.reasoningSummary.textContent = `Thought for ${seconds.toFixed(1)} s`;
    }
  }

  function appendAnswer(message, text) {
    if (!text) return;
    endReasoning(message);
    message.text += text;
    message.answerText.appendData(text);
  }

  function finishMessage(message, how, detail) {
    endReasoning(message);
    message.node.dataset.state = how;
    message.copy.hidden = !message.text;
    message.status.replaceChildren();
    if (how === "stopped") {
      message.status.append(el("span", { class: "badge stopped", "data-testid": "stopped-badge" },
                               "Stopped"));
    } else if (how === "error") {
      message.status.append(el("span", { class: "badge failed" }, "Failed"));
      message.body.append(el("div", { class: "error", "data-testid": "error" }, detail));
    }
  }

  function showFigures(message, usage, finishReason, started, firstToken) {
    const parts = [];
    const seconds = (performance.now() - started) / 1000;
    if (usage && Number.isFinite(usage.completion_tokens)) {
      parts.push(`${Tandem.formatInt(usage.completion_tokens)} tokens`);
      const decode = firstToken ? (performance.now() - firstToken) / 1000 : 0;
      if (usage.completion_tokens > 1 && decode > 0) {
        parts.push(`${((usage.completion_tokens - 1) / decode).toFixed(1)} tokens/s`);
      }
    }
    if (firstToken) parts.push(`first token ${Tandem.formatSeconds((firstToken - started) / 1000)}`);
    else parts.push(Tandem.formatSeconds(seconds));
    if (finishReason === "length") parts.push("hit the token limit");
    message.figures.textContent = parts.join(" · ");
    if (finishReason) message.node.dataset.finishReason = finishReason;
  }

  // ------------------------------------------------------------------ copying
  async function copyText(text, button) {
    let ok = false;
    if (navigator.clipboard && window.isSecureContext) {
      try {
        await navigator.clipboard.writeText(text);
        ok = true;
      } catch {
        /* denied: try the old way */
      }
    }
    if (!ok) ok = copyWithTextarea(text);
    const label = button.querySelector(".copy-label");
    label.textContent = ok ? "Copied" : "Copy failed";
    button.dataset.copied = ok ? "yes" : "no";
    clearTimeout(button.resetTimer);
    button.resetTimer = setTimeout(() => { label.textContent = "Copy"; }, 1500);
  }

  function copyIcon() {
    const ns = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("viewBox", "0 0 16 16");
    svg.setAttribute("fill", "none");
    svg.setAttribute("stroke", "currentColor");
    svg.setAttribute("stroke-width", "1.5");
    for (const [tag, attrs] of [
      ["rect", { x: "5.5", y: "5.5", width: "8", height: "8", rx: "1.5" }],
      ["path", { d: "M10.5 5.5V4a1.5 1.5 0 0 0-1.5-1.5H4A1.5 1.5 0 0 0 2.5 4v5A1.5 1.5 0 0 0 4 10.5h1.5" }],
    ]) {
      const shape = document.createElementNS(ns, tag);
      for (const [k, v] of Object.entries(attrs)) shape.setAttribute(k, v);
      svg.append(shape);
    }
    return svg;
  }

  // Plain http on another host than localhost has no clipboard API: a selected, hidden
  // textarea and execCommand("copy") still work there.
  function copyWithTextarea(text) {
    const area = el("textarea", { readonly: "", "aria-hidden": "true",
                                  style: "position:fixed;top:0;left:-9999px;opacity:0" });
    area.value = text;
    document.body.append(area);
    const selection = document.getSelection();
    const previous = selection.rangeCount ? selection.getRangeAt(0) : null;
    area.select();
    let ok = false;
    try {
      ok = document.execCommand("copy");
    } catch {
      ok = false;
    }
    area.remove();
    if (previous) {
      selection.removeAllRanges();
      selection.addRange(previous);
    }
    return ok;
  }

  // ------------------------------------------------------------------ streaming
  // Reads an event stream, calling `onData` with each event's data (lines joined).
  async function readEvents(response, onData) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let data = [];
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        let line = buffer.slice(0, end);
        buffer = buffer.slice(end + 1);
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          if (data.length && onData(data.join("\n")) === false) {
            await reader.cancel();
            return true;
          }
          data = [];
        } else if (line.startsWith("data:")) {
          data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
        } // comments (":") and other fields are not used by this server
      }
    }
    if (data.length) return onData(data.join("\n")) === false;
    return false;
  }

  async function send(text) {
    if (state.reply) return;
    if (!state.settings) await loadSettings();
    if (!state.settings) {
      ui.input.value = ui.input.value || text;
      return;
    }
    let fields;
    try {
      fields = requestFields();
    } catch (error) {
      setNote(error.message, true);
      return;
    }
    setNote("");
    const system = ui.system.value.trim();
    const turn = { role: "user", content: text };
    const messages = [
      ...(system ? [{ role: "system", content: system }] : []),
      ...state.history,
      turn,
    ];
    const userNode = addUserMessage(text);
    const message = addAssistantMessage();
    ui.messages.scrollTop = ui.messages.scrollHeight;

    const controller = new AbortController();
    const reply = { controller, stopped: false, conversation: state.conversation };
    state.reply = reply;
    setBusy(true);

    const body = {
      ...fields,
      model: state.settings.model,
      messages,
      stream: true,
      stream_options: { include_usage: true },
    };
    const started = performance.now();
    let firstToken = 0;
    let usage = null;
    let finishReason = null;
    let sawDone = false;
    let outcome = "done";
    let detail = "";
    try {
      const response = await Tandem.api("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!response.ok) {
        throw new Tandem.ApiError(await Tandem.errorMessage(response), response.status);
      }
      message.node.dataset.state = "streaming";
      await readEvents(response, (data) => {
        if (data === "[DONE]") {
          sawDone = true;
          return false;
        }
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Tandem.ApiError(chunk.error.message || String(chunk.error));
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) return true;
        const delta = choice.delta || {};
        const atBottom = scrolledToBottom();
        const thinking = delta.reasoning_content ?? delta.reasoning;
        if (thinking) {
          if (!firstToken) firstToken = performance.now();
          appendReasoning(message, thinking);
        }
        if (delta.content) {
          if (!firstToken) firstToken = performance.now();
          appendAnswer(message, delta.content);
        }
        if (choice.finish_reason) finishReason = choice.finish_reason;
        follow(atBottom);
        return true;
      });
      if (!sawDone && !reply.stopped) {
        throw new Error("The connection closed before the answer was complete.");
      }
    } catch (error) {
      if (reply.stopped || error.name === "AbortError") {
        outcome = "stopped";
      } else {
        outcome = "error";
        detail = error.message || String(error);
      }
    }

    // A turn joins the conversation if it has an answer (a stopped one, its part).
    if (reply.conversation !== state.conversation) {
      // "New chat" was pressed meanwhile: its messages are gone, the new history is not this.
    } else if (outcome !== "error" && message.text) {
      state.history.push(turn, { role: "assistant", content: message.text });
      message.node.dataset.inHistory = "yes";
    } else {
      userNode.classList.add("excluded");
      message.node.classList.add("excluded");
      userNode.title = message.node.title = "Not part of the conversation sent next";
      if (outcome === "error" && !ui.input.value.trim()) {
        ui.input.value = text; // to send again after fixing what was wrong
        autoGrow();
      }
    }
    finishMessage(message, outcome, detail);
    showFigures(message, usage, finishReason, started, firstToken);
    state.reply = null;
    setBusy(false);
    if (document.activeElement === document.body || document.activeElement === ui.stop) {
      ui.input.focus();
    }
  }

  function stop() {
    const reply = state.reply;
    if (!reply) return;
    reply.stopped = true;
    reply.controller.abort(); // closes the connection: the server aborts the request
  }

  function setBusy(busy) {
    ui.send.hidden = busy;
    ui.stop.hidden = !busy;
    document.body.dataset.busy = busy ? "yes" : "no";
  }

  function newChat() {
    stop();
    state.conversation++;
    state.history = [];
    for (const node of [...ui.messages.children]) {
      if (node !== ui.empty) node.remove();
    }
    ui.empty.hidden = false;
    setNote("");
    ui.input.focus();
  }

  function autoGrow() {
    ui.input.style.height = "auto";
    ui.input.style.height = `${Math.min(ui.input.scrollHeight, 220)}px`;
  }

  // ------------------------------------------------------------------ wiring
  ui.form.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = ui.input.value;
    if (!text.trim() || state.reply) return;
    ui.input.value = "";
    autoGrow();
    send(text);
  });

  ui.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      ui.form.requestSubmit();
    }
  });
  ui.input.addEventListener("input", autoGrow);

  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && state.reply && !document.querySelector(".modal-backdrop:not([hidden])")) {
      stop();
    }
  });

  ui.stop.addEventListener("click", stop);
  $('[data-testid="new-chat"]').addEventListener("click", newChat);
  $("#reset-sampling").addEventListener("click", resetSampling);

  const toggle = $('[data-testid="settings-toggle"]');
  toggle.addEventListener("click", () => {
    const open = document.body.classList.toggle("settings-open");
    toggle.setAttribute("aria-expanded", String(open));
  });
  ui.messages.addEventListener("click", () => {
    document.body.classList.remove("settings-open");
    toggle.setAttribute("aria-expanded", "false");
  });

  setBusy(false);
  loadSettings().then(() => ui.input.focus());
})();
