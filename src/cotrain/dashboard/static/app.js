// cotrain dashboard: polls api/state and draws charts as inline SVG (no external library, works offline).
"use strict";

const POLL_MS = 1500;
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, parent) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

function fmt(x, digits) {
  if (x === null || x === undefined || !isFinite(x)) return "-";
  const a = Math.abs(x);
  if (a >= 1e6) return (x / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (x / 1e3).toFixed(1) + "k";
  return Number.isInteger(x) && digits === undefined ? String(x) : x.toFixed(digits === undefined ? 2 : digits);
}

function ticks(lo, hi, n) {
  if (hi === lo) return [lo];
  const step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
  const err = (hi - lo) / n / step;
  const s = step * (err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1);
  const out = [];
  for (let t = Math.ceil(lo / s) * s; t <= hi + 1e-9 * s; t += s) out.push(t);
  return out;
}

// points: [[x, y], ...]; draws a line chart and records the number of points in data-points.
function lineChart(container, points, opts) {
  const w = container.clientWidth || 400, h = container.clientHeight || 190;
  const m = { l: 46, r: 12, t: 8, b: 24 };
  const svg = el("svg", { viewBox: `0 0 ${w} ${h}`, role: "img" });
  const pts = points.filter((p) => isFinite(p[0]) && isFinite(p[1]));
  container.dataset.points = String(pts.length);
  if (pts.length === 0) {
    const t = el("text", { x: w / 2, y: h / 2, "text-anchor": "middle", class: "empty" }, svg);
    t.textContent = (opts && opts.empty) || "waiting for the first global step";
    container.replaceChildren(svg);
    return;
  }
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
  if (opts && opts.zero) y0 = Math.min(0, y0);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 = y0 + Math.max(1, Math.abs(y0) * 0.1); }
  const pad = (y1 - y0) * 0.05; y1 += pad; if (!(opts && opts.zero)) y0 -= pad;
  const sx = (x) => m.l + ((x - x0) / (x1 - x0)) * (w - m.l - m.r);
  const sy = (y) => h - m.b - ((y - y0) / (y1 - y0)) * (h - m.t - m.b);
  for (const t of ticks(y0, y1, 4).filter((t) => !(opts && opts.integer) || Number.isInteger(t))) {
    el("line", { x1: m.l, x2: w - m.r, y1: sy(t), y2: sy(t), class: "grid" }, svg);
    el("text", { x: m.l - 4, y: sy(t) + 3, "text-anchor": "end" }, svg).textContent = fmt(t, opts && opts.yDigits);
  }
  for (const t of ticks(x0, x1, 5)) {
    const label = opts && opts.time ? new Date(t * 1000).toLocaleTimeString() : fmt(t, 0);
    el("text", { x: sx(t), y: h - m.b + 14, "text-anchor": "middle" }, svg).textContent = label;
  }
  el("line", { x1: m.l, x2: w - m.r, y1: h - m.b, y2: h - m.b, class: "axis" }, svg);
  el("line", { x1: m.l, x2: m.l, y1: m.t, y2: h - m.b, class: "axis" }, svg);
  const d = pts.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
  el("path", { d, class: "line" }, svg);
  if (pts.length <= 200 && !(opts && opts.time)) {
    for (const p of pts) el("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.5, class: "point" }, svg);
  }
  const title = el("title", {}, svg);
  title.textContent = `${pts.length} points`;
  container.replaceChildren(svg);
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 60) return `${seconds.toFixed(0)} s ago`;
  if (seconds < 3600) return `${(seconds / 60).toFixed(0)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "unknown";
  if (seconds < 90) return `${seconds.toFixed(0)} s`;
  if (seconds < 5400) return `${(seconds / 60).toFixed(0)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function megabytes(n) {
  return n === null || n === undefined ? "-" : `${(n / 1e6).toFixed(1)} MB`;
}

// a strategy of rounds (its peers report inner steps and bytes per round: diloco) shows them; sync hides them
function showStrategy(rounds) {
  for (const node of document.querySelectorAll(".diloco-only")) node.hidden = !rounds;
}

function renderPeers(peers, diloco) {
  const body = document.querySelector("#peers-table tbody");
  const rows = peers.map((p) => {
    const tr = document.createElement("tr");
    tr.dataset.peerId = p.peer_id || "";
    const cells = [
      [p.short_id || "?", ""], [p.client_mode ? "client" : "public", ""], [fmt(p.step), "num"],
      [fmt(p.samples_per_second, 1), "num"], [fmt(p.contribution), "num"], [ago(p.seconds_ago), ""],
    ];
    if (diloco) cells.push([fmt(p.inner_steps), "num"], [megabytes(p.round_bytes), "num"]);
    for (const [text, cls] of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    tr.firstChild.title = p.peer_id || "";
    return tr;
  });
  body.replaceChildren(...rows);
}

function render(data) {
  const steps = data.steps || [];
  const state = data.state || {};
  const last = steps.length ? steps[steps.length - 1] : {};
  const strategy = data.strategy || state.strategy || "";
  // what the strategy says of itself (Strategy.step_name, Strategy.peer_fields), not its name
  const diloco = (data.peer_fields || []).includes("round_bytes");
  const stepName = data.step_name || "global step";
  showStrategy(diloco);
  document.getElementById("run-id").textContent = data.run_id;
  document.getElementById("strategy").textContent = strategy;
  document.getElementById("step-label").textContent = stepName;
  document.getElementById("progress-title").textContent = `Next ${stepName}`;
  document.getElementById("step").textContent = fmt(state.global_step ?? last.step);
  if (diloco) {
    document.getElementById("inner-steps").textContent = fmt(state.inner_steps ?? last.inner_steps);
    document.getElementById("round-bytes").textContent = megabytes(state.round_bytes ?? last.round_bytes);
    lineChart(document.getElementById("chart-round-bytes"),
      steps.filter((r) => r.round_bytes).map((r) => [r.step, r.round_bytes / 1e6]),
      { zero: true, yDigits: 1, empty: "waiting for the first averaged round" });
  }
  document.getElementById("peers").textContent = fmt(state.num_peers ?? last.alive_peers);
  document.getElementById("throughput").textContent = fmt(state.samples_per_second ?? last.samples_per_second, 1);
  document.getElementById("loss").textContent = fmt(last.loss, 3);
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  const withLoss = steps.filter((r) => r.loss !== null && r.loss !== undefined);
  lineChart(document.getElementById("chart-loss-step"), withLoss.map((r) => [r.step, r.loss]), { yDigits: 2 });
  lineChart(document.getElementById("chart-loss-samples"), withLoss.map((r) => [r.samples, r.loss]), { yDigits: 2 });
  lineChart(document.getElementById("chart-throughput"), steps.map((r) => [r.step, r.samples_per_second]), { zero: true, yDigits: 1 });
  lineChart(document.getElementById("chart-alive"), (data.alive || []).map((a) => [a[0], a[1]]), { zero: true, time: true, integer: true, yDigits: 0 });
  renderPeers(state.peers || [], diloco);
  const target = state.step_samples || data.step_samples || state.target_batch_size || data.target_batch_size;
  const acc = state.samples_accumulated || 0;
  const pct = target ? Math.min(100, (100 * acc) / target) : 0;
  document.getElementById("progress-bar").style.width = `${pct.toFixed(1)}%`;
  const next = `${stepName.split(" ").pop()} ${fmt((state.global_step || 0) + 1)}: ${fmt(acc)} of ${fmt(target)} samples`;
  document.getElementById("progress-text").textContent = !state.num_peers
    ? "no trainer has reported progress yet"
    : acc >= target
      ? `${next}: target reached, the peers are averaging`
      : `${next} (${pct.toFixed(0)}%), ETA ${duration(state.eta_seconds)}`;
  document.getElementById("join-command").textContent = data.join_command;
  const ckpt = data.checkpoint;
  document.getElementById("checkpoint").textContent = ckpt ? `step ${ckpt.step}: ${ckpt.path}` : "none yet";
  const ev = data.evaluation;
  const evalNames = [["eval_loss", "loss"], ["eval_perplexity", "perplexity"], ["eval_mlm_accuracy", "MLM accuracy"],
    ["eval_sop_accuracy", "sentence-order accuracy"], ["eval_examples", "examples"]];
  document.getElementById("evaluation").textContent = ev
    ? `step ${fmt(ev.step)}: ` + evalNames.filter(([k]) => ev[k] !== undefined && ev[k] !== null)
      .map(([k, name]) => `${name} ${fmt(ev[k], k === "eval_examples" ? undefined : 3)}`).join(", ")
    : "no evaluation peer";
  lineChart(document.getElementById("chart-eval-loss"), (data.evaluations || []).map((r) => [r.step, r.eval_loss]),
    { yDigits: 2, empty: "no evaluation peer yet (cotrain eval)" });
}

async function poll() {
  try {
    const response = await fetch("api/state", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
  } catch (e) {
    document.getElementById("updated").textContent = `monitor unreachable (${e.message}); retrying`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

document.getElementById("copy").addEventListener("click", async () => {
  const text = document.getElementById("join-command").textContent;
  const button = document.getElementById("copy");
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "copied";
  } catch (e) {
    const range = document.createRange();
    range.selectNodeContents(document.getElementById("join-command"));
    window.getSelection().removeAllRanges();
    window.getSelection().addRange(range);
    button.textContent = "press Ctrl+C";
  }
  setTimeout(() => { button.textContent = "copy"; }, 1500);
});

poll();
