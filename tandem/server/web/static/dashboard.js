// The dashboard: polls GET /dashboard/data about once a second (the next poll only after the
// previous answer) and redraws when an answer comes, never in an animation loop: an open page
// costs the server one small request a second. Polling stops while the page is hidden.
"use strict";

(() => {
  const { el } = Tandem;

  const POLL_MS = 1000;
  const WINDOWS = [0.25, 1, 4, 10]; // timeline windows, seconds
  const KEEP_S = Math.max(...WINDOWS) + 0.5; // steps older than the widest window are dropped
  const MAX_STEPS = 50000; // and never more than this many per engine
  const RATE_S = 3; // tokens/s over about this long
  const LATENCY_S = 5; // TTFT and ITL means over about this long
  const SPARK_POINTS = 60;
  const OFFSET_SAMPLES = 30;
  // Host phases as `tandem.metrics.plot_timeline` colours them, plus the core's I/O.
  const PHASE_COLORS = {
    schedule: "#4c72b0", build: "#55a868", launch: "#8172b2", grammar: "#937860",
    wait: "#cccccc", update: "#dd8452", send: "#64b5cd", receive: "#da8bc3",
  };
  const DEVICE_COLORS = ["#c44e52", "#8c2d2f"]; // alternate steps: the idle gaps show

  const state = {
    window: Number(localStorage.getItem("tandem.dashboard.window")) || 1,
    engines: [], // per engine: see makeEngine
    after: null, // the last step id had per engine; null: first call
    samples: [], // server figures: {t, server}
    paused: false,
    timer: 0,
    inFlight: false,
    model: null,
  };
  if (!WINDOWS.includes(state.window)) state.window = 1;

  const $ = (selector, root = document) => root.querySelector(selector);

  // ------------------------------------------------------------------ engines' panels
  function makeEngine(index) {
    const node = $("#engine-template").content.firstElementChild.cloneNode(true);
    node.dataset.testid = `engine-${index}`;
    node.setAttribute("data-testid", `engine-${index}`);
    $(".engine-title", node).textContent = `Engine ${index}`;
    const roles = {};
    for (const child of node.querySelectorAll("[data-role]")) {
      roles[child.dataset.role] = child;
      child.setAttribute("data-testid", `engine-${index}-${child.dataset.role}`);
    }
    for (const button of roles.windows.querySelectorAll("button")) {
      button.setAttribute("data-testid", `engine-${index}-window-${button.dataset.window}`);
      button.addEventListener("click", () => setWindow(Number(button.dataset.window)));
    }
    roles.execution.addEventListener("click", () => roles.execution.classList.toggle("expanded"));
    const legend = roles.legend;
    for (const [name, color] of Object.entries(PHASE_COLORS)) {
      legend.append(el("span", {}, el("i", { style: `background:${color}` }), name));
    }
    legend.append(el("span", {},
      el("i", { style: `background:linear-gradient(90deg,${DEVICE_COLORS[0]} 50%,${DEVICE_COLORS[1]} 50%)` }),
      "device (alternate steps; gaps: idle)"));
    $("#engines").append(node);
    const engine = {
      index, node, roles,
      steps: [], // {id, tokens, seqs, d0, d1, skipped, spans}, core clock, oldest first
      lastId: -1,
      offsets: [], // page seconds minus core seconds, one per answer (latency included)
      now: null, // the core's clock at its latest answer
      stats: null,
      rates: [], // {t, tokens}
      spark: [],
      busy: false, // the core was too busy to answer in time
    };
    markWindow(engine);
    roles.timeline.addEventListener("mousemove", (event) => hover(engine, event));
    roles.timeline.addEventListener("mouseleave", () => { roles.tooltip.hidden = true; });
    return engine;
  }

  function markWindow(engine) {
    for (const button of engine.roles.windows.querySelectorAll("button")) {
      button.setAttribute("aria-pressed", String(Number(button.dataset.window) === state.window));
    }
  }

  function setWindow(seconds) {
    state.window = seconds;
    for (const engine of state.engines) markWindow(engine);
    try {
      localStorage.setItem("tandem.dashboard.window", String(seconds));
    } catch { /* not kept */ }
    for (const engine of state.engines) drawTimeline(engine);
  }

  // ------------------------------------------------------------------ polling
  function schedule(delay) {
    clearTimeout(state.timer);
    state.timer = setTimeout(poll, delay);
  }

  async function poll() {
    if (state.inFlight || state.paused || document.hidden) return;
    state.inFlight = true;
    const started = performance.now();
    let delay = POLL_MS;
    try {
      const query = state.after ? `?after=${state.after.join(",")}` : "";
      const data = await Tandem.getJSON(`/dashboard/data${query}`);
      ingest(data, performance.now() / 1000);
      render();
      setStatus("live", "Live", `Updated at ${new Date().toLocaleTimeString()}`);
      $('[data-testid="error"]').hidden = true;
    } catch (error) {
      delay = 3000;
      if (error.status === 400) state.after = null; // the engines changed: start over
      const message = error.status === 401 ? "An API key is needed." : error.message;
      setStatus("error", `Not updating: ${message}`);
      const banner = $('[data-testid="error"]');
      banner.replaceChildren(`The dashboard could not read the server: ${message} `);
      if (error.status === 401) {
        const retry = el("button", { type: "button", class: "btn small", "data-testid": "enter-key" },
                         "Enter an API key");
        retry.addEventListener("click", () => schedule(0));
        banner.append(retry);
      } else {
        banner.append("Retrying…");
      }
      banner.hidden = false;
      if (error.status === 401) delay = 0; // no retries until asked
    } finally {
      state.inFlight = false;
    }
    if (delay) schedule(Math.max(200, delay - (performance.now() - started)));
  }

  // The state in the top bar; its text changes only with the state (a text that changed every
  // second would lay out the bar every second), the time of the latest answer is its tooltip.
  function setStatus(kind, text, title = text) {
    const node = $('[data-testid="status"]');
    if (node.dataset.state !== kind) node.dataset.state = kind;
    const label = $(".live-text", node);
    if (label.textContent !== text) label.textContent = text;
    node.title = title;
  }

  // ------------------------------------------------------------------ the data
  function ingest(data, received) {
    if (data.model !== state.model) {
      state.model = data.model;
      $('[data-testid="model-name"]').textContent = data.model;
      $('[data-testid="context-length"]').textContent = `${Tandem.formatInt(data.max_model_len)} ctx`;
      document.title = `${data.model} · Tandem dashboard`;
    }
    while (state.engines.length < data.engines.length) {
      state.engines.push(makeEngine(state.engines.length));
    }
    for (const item of data.engines) {
      const engine = state.engines[item.engine];
      engine.stats = item.stats;
      if (item.execution !== engine.execution) {
        engine.execution = item.execution;
        engine.roles.execution.textContent = item.execution;
        engine.roles.execution.title = item.execution;
      }
      engine.busy = item.timeline === null;
      if (item.timeline) addSteps(engine, item.timeline, received);
      if (item.stats) {
        engine.rates.push({ t: received, tokens: item.stats.generation_tokens });
        trimSamples(engine.rates, received, RATE_S + 1);
        const previous = engine.rates[engine.rates.length - 2];
        if (previous) pushSpark(engine.spark, rate(previous, engine.rates.at(-1), "tokens"));
      }
    }
    state.after = state.engines.map((engine) => engine.lastId);
    state.samples.push({ t: received, server: data.server || {} });
    trimSamples(state.samples, received, Math.max(RATE_S, LATENCY_S) + 1);
    const samples = state.samples;
    if (samples.length >= 2) {
      const [a, b] = samples.slice(-2);
      pushSpark(state.spark, counterRate(a, b, "tandem_generation_tokens_total"));
    }
  }

  function addSteps(engine, timeline, received) {
    engine.now = timeline.now;
    engine.offsets.push(received - timeline.now);
    if (engine.offsets.length > OFFSET_SAMPLES) engine.offsets.shift();
    for (const [id, tokens, seqs, device, wait, skipped, spans] of timeline.steps) {
      if (id <= engine.lastId) continue; // had it already
      let begin = device[0];
      let end = device[1];
      for (const phase in spans) {
        begin = Math.min(begin, spans[phase][0]);
        end = Math.max(end, spans[phase][1]);
      }
      engine.steps.push({ id, tokens, seqs, d0: device[0], d1: device[1], wait, skipped, spans,
                          begin, end });
      engine.lastId = id;
    }
    // Drop what the widest window no longer shows.
    const oldest = timeline.now - KEEP_S;
    let drop = 0;
    while (drop < engine.steps.length && engine.steps[drop].end < oldest) drop++;
    drop = Math.max(drop, engine.steps.length - MAX_STEPS);
    if (drop > 0) engine.steps.splice(0, drop);
  }

  // Page seconds minus core seconds: the smallest difference seen lately is the one with the
  // least latency in it (as NTP estimates an offset).
  function offset(engine) {
    return Math.min(...engine.offsets);
  }

  function trimSamples(samples, now, keep) {
    // Keep one sample older than the span, so that a rate covers all of it.
    while (samples.length > 2 && samples[1].t < now - keep) samples.shift();
  }

  function rate(a, b, key) {
    const dt = b.t - a.t;
    return dt > 0 ? (b[key] - a[key]) / dt : NaN;
  }

  function counterRate(a, b, name) {
    const dt = b.t - a.t;
    const va = a.server[name];
    const vb = b.server[name];
    return dt > 0 && Number.isFinite(va) && Number.isFinite(vb) ? (vb - va) / dt : NaN;
  }

  function pushSpark(values, value) {
    values.push(Number.isFinite(value) ? Math.max(0, value) : 0);
    if (values.length > SPARK_POINTS) values.shift();
  }

  // The sample closest to `seconds` before the latest (the oldest one if none is that old).
  function sampleBefore(samples, seconds) {
    const latest = samples[samples.length - 1];
    let chosen = samples[0];
    for (const sample of samples) {
      if (sample.t <= latest.t - seconds) chosen = sample;
    }
    return chosen;
  }

  // ------------------------------------------------------------------ rendering
  function show(node, value, text) {
    const raw = value === null || value === undefined ? "" : String(value);
    if (node.dataset.value !== raw) node.dataset.value = raw;
    if (node.textContent !== text) node.textContent = text;
  }

  // Only what changed is written: an unchanged page costs the browser no style or layout.
  function setStyle(node, property, value) {
    if (node.style.getPropertyValue(property) !== value) node.style.setProperty(property, value);
  }

  function render() {
    renderServer();
    for (const engine of state.engines) renderEngine(engine);
  }

  function renderServer() {
    const samples = state.samples;
    const latest = samples[samples.length - 1];
    const server = latest.server;
    const q = (id) => $(`[data-testid="${id}"]`);
    if (samples.length >= 2) {
      const rateFrom = sampleBefore(samples, RATE_S);
      const tps = counterRate(rateFrom, latest, "tandem_generation_tokens_total");
      show(q("server-tokens-per-s"), Number.isFinite(tps) ? tps : null, Tandem.formatRate(tps));
      const from = sampleBefore(samples, LATENCY_S);
      for (const [id, name] of [["server-ttft", "tandem_time_to_first_token_seconds"],
                                ["server-itl", "tandem_inter_token_latency_seconds"]]) {
        const count = (server[`${name}_count`] ?? 0) - (from.server[`${name}_count`] ?? 0);
        const sum = (server[`${name}_sum`] ?? 0) - (from.server[`${name}_sum`] ?? 0);
        const mean = count > 0 ? sum / count : NaN;
        show(q(id), Number.isFinite(mean) ? mean : null, Tandem.formatSeconds(mean));
      }
    }
    const totals = [
      ["server-in-flight", "tandem_requests_in_flight"],
      ["server-generation-tokens", "tandem_generation_tokens_total"],
      ["server-prompt-tokens", "tandem_prompt_tokens_total"],
      ["server-rejected", "tandem_requests_rejected_total"],
    ];
    for (const [id, name] of totals) {
      const value = server[name] ?? 0; // absent before the first request
      show(q(id), value, Tandem.formatInt(value));
    }
    drawSpark(q("server-spark"), state.spark);
  }

  function renderEngine(engine) {
    const r = engine.roles;
    const s = engine.stats;
    if (s) {
      const idle = Math.max(0, Math.min(1, s.device_idle_fraction));
      setStyle(r.gauge, "--idle", idle.toFixed(3));
      show(r.idle, s.device_idle_fraction, Tandem.formatPercent(s.device_idle_fraction));
      show(r.running, s.num_running, Tandem.formatInt(s.num_running));
      show(r.waiting, s.num_waiting, Tandem.formatInt(s.num_waiting));
      show(r["kv-used"], s.kv_blocks_used, Tandem.formatInt(s.kv_blocks_used));
      show(r["kv-cached"], s.kv_blocks_cached, Tandem.formatInt(s.kv_blocks_cached));
      show(r["kv-total"], s.kv_blocks_total, Tandem.formatInt(s.kv_blocks_total));
      const total = Math.max(1, s.kv_blocks_total);
      setStyle($(".used", r["kv-bar"]), "width", `${((100 * s.kv_blocks_used) / total).toFixed(2)}%`);
      setStyle($(".cached", r["kv-bar"]), "width",
               `${((100 * s.kv_blocks_cached) / total).toFixed(2)}%`);
      const free = s.kv_blocks_total - s.kv_blocks_used - s.kv_blocks_cached;
      const title = `${s.kv_blocks_used} used, ${s.kv_blocks_cached} cached, ${free} free`;
      if (r["kv-bar"].title !== title) r["kv-bar"].title = title;
      show(r.steps, s.num_steps, Tandem.formatInt(s.num_steps));
      show(r["generation-tokens"], s.generation_tokens, Tandem.formatInt(s.generation_tokens));
      show(r["prefix-hit-rate"], s.prefix_hit_rate, Tandem.formatPercent(s.prefix_hit_rate));
      show(r.preemptions, s.num_preemptions, Tandem.formatInt(s.num_preemptions));
      if (r.spec.hidden !== !s.spec_method) r.spec.hidden = !s.spec_method;
      if (s.spec_method) {
        show(r["spec-method"], s.spec_method, s.spec_method);
        show(r["spec-acceptance"], s.spec_acceptance_rate,
             Tandem.formatPercent(s.spec_acceptance_rate));
        show(r["spec-length"], s.spec_mean_accepted_length,
             s.spec_mean_accepted_length.toFixed(2));
      }
    }
    if (engine.rates.length >= 2) {
      const from = sampleBefore(engine.rates, RATE_S);
      const tps = rate(from, engine.rates.at(-1), "tokens");
      show(r["tokens-per-s"], Number.isFinite(tps) ? tps : null, Tandem.formatRate(tps));
    }
    drawSpark(r.spark, engine.spark);
    drawTimeline(engine);
  }

  // The theme's colours, read once and again when the system's theme changes (reading
  // computed styles on every draw would make the browser update styles first).
  let theme = null;
  function readTheme() {
    const style = getComputedStyle(document.documentElement);
    const v = (name) => style.getPropertyValue(name).trim();
    theme = { accent: v("--accent"), muted: v("--muted"), border: v("--border"), font: v("--font") };
  }

  // Canvas sizes, as the ResizeObserver reports them: read on every draw, a size would force a
  // layout of what the same answer just changed.
  const sizes = new WeakMap();
  const resizes = new ResizeObserver((entries) => {
    for (const entry of entries) {
      const box = entry.contentRect;
      sizes.set(entry.target, { width: box.width, height: box.height });
    }
    redrawAll();
  });

  function redrawAll() {
    for (const engine of state.engines) {
      drawSpark(engine.roles.spark, engine.spark);
      drawTimeline(engine);
    }
    drawSpark($('[data-testid="server-spark"]'), state.spark);
  }

  // A canvas sized to its box at the screen's pixel ratio; returns its context and size.
  function prepare(canvas) {
    const ratio = window.devicePixelRatio || 1;
    let size = sizes.get(canvas);
    if (!size) {
      resizes.observe(canvas);
      size = { width: canvas.clientWidth, height: canvas.clientHeight };
      sizes.set(canvas, size);
    }
    const { width, height } = size;
    if (!width || !height) return null;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    return { ctx, width, height };
  }

  function drawSpark(canvas, values) {
    const drawing = prepare(canvas);
    if (!drawing || values.length < 2) return;
    const { ctx, width, height } = drawing;
    const top = Math.max(...values) || 1;
    const step = width / (values.length - 1); // stretched until the history is full
    const x0 = 0;
    const y = (v) => height - 2 - (v / top) * (height - 4);
    ctx.beginPath();
    values.forEach((v, i) => (i ? ctx.lineTo(x0 + i * step, y(v)) : ctx.moveTo(x0, y(v))));
    const accent = theme.accent;
    ctx.strokeStyle = accent;
    ctx.lineWidth = 1.5;
    ctx.lineJoin = "round";
    ctx.stroke();
    ctx.lineTo(width, height);
    ctx.lineTo(x0, height);
    ctx.closePath();
    ctx.globalAlpha = 0.15;
    ctx.fillStyle = accent;
    ctx.fill();
    ctx.globalAlpha = 1;
  }

  const LABEL_W = 58;
  const AXIS_H = 18;
  const HOST = { y: 10, h: 28 };
  const DEVICE = { y: 46, h: 28 };

  // The window's geometry: core-clock seconds to x for this engine.
  function frame(engine, width) {
    const edge = latestEdge(); // page seconds at the right edge
    const shift = offset(engine);
    const plot = width - LABEL_W - 8;
    const scale = plot / state.window;
    return {
      x: (t) => LABEL_W + plot - (edge - (t + shift)) * scale,
      t: (x) => edge - shift - (LABEL_W + plot - x) / scale,
      start: edge - shift - state.window, // core clock
      end: edge - shift,
      plot,
      scale,
    };
  }

  // The right edge: the latest answer of any engine, on the page's clock.
  function latestEdge() {
    let edge = -Infinity;
    for (const engine of state.engines) {
      if (engine.now !== null && engine.offsets.length) {
        edge = Math.max(edge, engine.now + offset(engine));
      }
    }
    return edge;
  }

  // "#rrggbb" as a pixel of a Uint32Array over ImageData (little-endian RGBA); 0: none.
  function pixel(hex) {
    const n = parseInt(hex.slice(1, 7), 16);
    if (!/^#[0-9a-f]{6}$/i.test(hex) || Number.isNaN(n)) return 0xff888888;
    return (0xff000000 | ((n & 0xff) << 16) | (n & 0xff00) | (n >> 16)) >>> 0;
  }

  const PHASE_PIXELS = Object.fromEntries(
    Object.entries(PHASE_COLORS).map(([phase, color]) => [phase, pixel(color)])
  );
  const DEVICE_PIXELS = DEVICE_COLORS.map(pixel);

  // The first step that ends at or after `t` (steps are in order).
  function firstEndingAfter(steps, t) {
    let lo = 0;
    let hi = steps.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (steps[mid].end < t) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }

  // The lanes are painted as columns of pixels, one ImageData per lane, rather than as a
  // rectangle per span: thousands of spans cost the browser no more than a few.
  function drawTimeline(engine) {
    const canvas = engine.roles.timeline;
    const drawing = prepare(canvas);
    if (!drawing) return;
    const { ctx, width, height } = drawing;
    const { muted } = theme;
    ctx.font = `11px ${theme.font}`;
    ctx.textBaseline = "middle";
    const labelLanes = () => {
      ctx.fillStyle = muted;
      ctx.fillText("host", 10, HOST.y + HOST.h / 2);
      ctx.fillText("device", 10, DEVICE.y + DEVICE.h / 2);
    };
    labelLanes();
    if (engine.now === null || !engine.offsets.length) {
      ctx.fillText(engine.busy ? "the core was busy: no steps yet" : "waiting for data…",
                   LABEL_W + 8, height / 2 + 20);
      return;
    }
    const f = frame(engine, width);
    const ratio = canvas.width / width; // device pixels per CSS pixel
    const columns = canvas.width;
    const left = Math.round(LABEL_W * ratio);
    const right = Math.round((LABEL_W + f.plot) * ratio);
    const host = new Uint32Array(columns);
    const device = new Uint32Array(columns);
    const paint = (lane, a, b, color) => {
      let x0 = Math.floor(f.x(a) * ratio);
      let x1 = Math.ceil(f.x(b) * ratio);
      if (x1 <= x0) x1 = x0 + 1; // a span too short to see still gets a pixel
      x0 = Math.max(x0, left);
      x1 = Math.min(x1, right);
      if (x1 > x0) lane.fill(color, x0, x1);
    };
    // The steps in the window: host phases above, device spans below.
    let first = null;
    let last = null;
    let busy = 0;
    let shown = 0;
    const steps = engine.steps;
    for (let i = firstEndingAfter(steps, f.start); i < steps.length; i++) {
      const step = steps[i];
      if (step.begin > f.end) break;
      shown++;
      first ??= step.id;
      last = step.id;
      for (const phase in step.spans) {
        const [a, b] = step.spans[phase];
        if (b >= f.start && a <= f.end) paint(host, a, b, PHASE_PIXELS[phase] || 0xff888888);
      }
      if (!step.skipped && step.d1 > step.d0) {
        const a = Math.max(step.d0, f.start);
        const b = Math.min(step.d1, f.end);
        if (b > a) busy += b - a;
        paint(device, step.d0, step.d1, DEVICE_PIXELS[step.id % 2]);
      }
    }
    for (const [lane, y, h] of [[host, HOST.y, HOST.h], [device, DEVICE.y, DEVICE.h]]) {
      const rows = Math.round(h * ratio);
      const image = ctx.createImageData(columns, rows);
      const pixels = new Uint32Array(image.data.buffer);
      for (let row = 0; row < rows; row++) pixels.set(lane, row * columns);
      ctx.putImageData(image, 0, Math.round(y * ratio));
    }
    labelLanes(); // the lanes' pixels span the canvas, the labels' columns too
    // The axis: ticks back from the right edge ("now": the latest answer), over the lanes.
    // Ticks at least ~72 px apart, at 1, 2 or 5 times a power of ten.
    const tick = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10].find((t) => t * f.scale >= 72) || 10;
    ctx.strokeStyle = theme.border;
    ctx.globalAlpha = 0.8;
    ctx.lineWidth = 1;
    ctx.textAlign = "center";
    const axisY = height - AXIS_H / 2;
    ctx.beginPath();
    const labels = [];
    for (let i = 0; i * tick <= state.window + 1e-9; i++) {
      const back = i * tick;
      const x = Math.round(LABEL_W + f.plot - back * f.scale) + 0.5;
      ctx.moveTo(x, HOST.y - 4);
      ctx.lineTo(x, HOST.y);
      ctx.moveTo(x, HOST.y + HOST.h);
      ctx.lineTo(x, DEVICE.y);
      ctx.moveTo(x, DEVICE.y + DEVICE.h);
      ctx.lineTo(x, DEVICE.y + DEVICE.h + 4);
      const ms = Math.round(back * 1000);
      labels.push([back === 0 ? "now" : ms < 1000 ? `−${ms} ms` : `−${+back.toFixed(2)} s`, x]);
    }
    ctx.stroke();
    ctx.globalAlpha = 1;
    ctx.fillStyle = muted;
    for (const [label, x] of labels) {
      ctx.fillText(label, Math.min(Math.max(x, LABEL_W + 20), width - 22), axisY);
    }
    ctx.textAlign = "left";
    if (last !== null && canvas.dataset.lastStep !== String(last)) {
      canvas.dataset.lastStep = String(last);
    }
    canvas.dataset.stepsShown = String(shown);
    const info = shown
      ? `steps ${first}–${last} · ${shown} in view · device busy ` +
        `${Tandem.formatPercent(busy / state.window)} of the window`
      : "no steps in this window: idle";
    const text = engine.busy ? `${info} · core busy, not answering` : info;
    const node = engine.roles["timeline-info"];
    if (node.textContent !== text) node.textContent = text;
  }

  // A tooltip for the step under the pointer (drawn from what is held, no request).
  function hover(engine, event) {
    const tooltip = engine.roles.tooltip;
    const canvas = engine.roles.timeline;
    if (engine.now === null || !engine.offsets.length) return;
    const rect = canvas.getBoundingClientRect();
    const x = event.clientX - rect.left;
    const y = event.clientY - rect.top;
    const f = frame(engine, rect.width);
    const t = f.t(x);
    let found = null;
    let phase = "";
    const onDevice = y >= DEVICE.y - 4;
    for (const step of engine.steps) {
      if (onDevice && step.d0 <= t && t <= step.d1) {
        found = step;
        phase = "device";
        break;
      }
      if (!onDevice) {
        for (const [name, [a, b]] of Object.entries(step.spans)) {
          if (a <= t && t <= b) {
            found = step;
            phase = name;
          }
        }
        if (found) break;
      }
    }
    if (!found || x < LABEL_W) {
      tooltip.hidden = true;
      return;
    }
    const span = phase === "device" ? [found.d0, found.d1] : found.spans[phase];
    const lines = [
      `step ${found.id}${found.skipped ? " (skipped)" : ""}: ` +
        `${found.seqs} sequences, ${found.tokens} tokens`,
      `${phase}: ${Tandem.formatSeconds(span[1] - span[0])}`,
    ];
    if (phase !== "device") lines.push(`device: ${Tandem.formatSeconds(found.d1 - found.d0)}`);
    else if (found.wait > 0) lines.push(`waiting for a grammar: ${Tandem.formatSeconds(found.wait)}`);
    tooltip.textContent = lines.join("\n");
    tooltip.hidden = false;
    const left = Math.min(x + 12, rect.width - tooltip.offsetWidth - 4);
    tooltip.style.left = `${Math.max(4, left)}px`;
  }

  // ------------------------------------------------------------------ wiring
  const pause = $('[data-testid="pause"]');
  pause.addEventListener("click", () => {
    state.paused = !state.paused;
    pause.setAttribute("aria-pressed", String(state.paused));
    pause.textContent = state.paused ? "Resume" : "Pause";
    if (state.paused) {
      clearTimeout(state.timer);
      setStatus("paused", "Paused");
    } else {
      schedule(0);
    }
  });

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && !state.paused) schedule(0);
  });

  matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => {
    readTheme();
    redrawAll();
  });

  readTheme();
  state.spark = [];
  poll();
})();
