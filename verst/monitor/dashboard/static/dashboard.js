// verst dashboard: polls /api/run/<i> for each run, merges records by step, draws uPlot charts.
"use strict";

const POLL_MS = Number(new URLSearchParams(location.search).get("poll_ms") || 2000);
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf"];
// optional panels are left out (not reported) when no run has their keys: async-only metrics
const PANELS = [
  { id: "reward", title: "reward (rollout/reward_mean)", keys: ["rollout/reward_mean"] },
  { id: "eval", title: "held-out accuracy (eval/accuracy)", keys: ["eval/accuracy"] },
  { id: "length", title: "response length, tokens", keys: ["rollout/response_len_mean"] },
  { id: "kl", title: "train vs rollout: |log-prob diff| and KL", log: true,
    keys: ["train/train_rollout_logprob_abs_diff", "train/train_rollout_kl", "train/kl_loss"] },
  { id: "gnorm", title: "gradient norm (train/grad_norm)", keys: ["train/grad_norm"] },
  { id: "throughput", title: "throughput, tokens/s",
    keys: ["perf/tokens_per_s", "engine/generation_tokens_per_s"] },
  { id: "cache", title: "engine: prefix-cache hit rate and KV usage",
    keys: ["engine/cache_hit_rate", "engine/token_usage"] },
  { id: "buffer", title: "buffer size and staleness (fully async)", optional: true,
    keys: ["buffer/queue_size", "buffer/staleness_mean", "buffer/staleness_max"] },
];
const PHASE = /^perf\/(.+)_time_s$/;
const LOOP_ORDER = ["rollout", "wait", "reward", "teacher", "advantages", "train", "sync", "eval",
  "checkpoint"];

const runs = [];  // {id, label, cursor, byStep: Map(step -> row), skipped, advice, sampleSteps}
const charts = new Map();  // panel id -> {plot, signature}
let sampleFollow = true;  // the step chooser follows the latest step until the user picks one

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
}

function merge(run, update) {
  if (update.reset) run.byStep = new Map();
  for (const rec of update.records) {
    const old = run.byStep.get(rec.step);
    if (rec.record !== undefined && old) {
      const { record, ...rest } = rec;
      Object.assign(old, rest);
    } else {
      run.byStep.set(rec.step, { ...rec });
    }
  }
  run.cursor = update.cursor;
  run.skipped = update.skipped;
  run.advice = update.advice;
  run.sampleSteps = update.sample_steps;
}

function rowsOf(run) {
  return [...run.byStep.keys()].sort((a, b) => a - b).map((s) => run.byStep.get(s));
}

function has(run, key) {
  for (const row of run.byStep.values()) if (row[key] !== undefined) return true;
  return false;
}

// [{label, points: Map(step -> value)}] -> uPlot's aligned data and the count of values drawn
function aligned(lines) {
  const steps = [...new Set(lines.flatMap((l) => [...l.points.keys()]))].sort((a, b) => a - b);
  let drawn = 0;
  const ys = lines.map((l) => steps.map((s) => {
    const v = l.points.get(s);
    if (v === undefined || v === null) return null;
    drawn += 1;
    return v;
  }));
  return { data: [steps, ...ys], drawn };
}

function series(run, key) {
  const points = new Map();
  for (const row of rowsOf(run)) {
    const v = row[key];
    if (typeof v === "number" && Number.isFinite(v)) points.set(row.step, v);
  }
  return points;
}

function curveLines(panel, notes) {
  const lines = [];
  const holders = runs.filter((r) => panel.keys.some((k) => has(r, k)));
  for (const [i, run] of runs.entries()) {
    const present = panel.keys.filter((k) => has(run, k));
    if (!present.length && holders.length && run.byStep.size) {
      notes.push(`${panel.title}: ${run.label} has no ${panel.keys.join(" / ")}`);
    }
    for (const [j, key] of present.entries()) {
      const label = panel.keys.length === 1 ? run.label : `${run.label}: ${key.split("/")[1]}`;
      const color = COLORS[(i * panel.keys.length + j) % COLORS.length];
      lines.push({ label, color, points: series(run, key), dash: j ? [6, 3] : undefined });
    }
  }
  return lines;
}

function topPhases(run) {
  const phases = new Set();
  for (const row of run.byStep.values()) {
    for (const key of Object.keys(row)) {
      const m = PHASE.exec(key);
      if (m && m[1] !== "step") phases.add(m[1]);
    }
  }
  const top = [...phases].filter((p) => ![...phases].some((q) => q !== p && p.startsWith(q + "_")));
  const rank = (p) => (LOOP_ORDER.includes(p) ? LOOP_ORDER.indexOf(p) : 99);
  return top.sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
}

// the stacked phase breakdown of one run: each line is the sum of its phase and those below
function phaseLines(run) {
  const phases = topPhases(run);
  const rows = rowsOf(run).filter((r) => typeof r["perf/step_time_s"] === "number");
  const totals = new Map(rows.map((r) => [r.step, 0]));
  const lines = phases.map((phase, i) => {
    const points = new Map();
    for (const row of rows) {
      const v = row[`perf/${phase}_time_s`];
      const sum = totals.get(row.step) + (typeof v === "number" ? v : 0);
      totals.set(row.step, sum);
      points.set(row.step, sum);
    }
    const color = COLORS[i % COLORS.length];
    return { label: phase, color, fill: color + "99", points };
  });
  return lines.reverse();  // the tallest first, so each smaller band paints over it
}

function panelBox(id, title) {
  let box = document.getElementById(`panel-${id}`);
  if (!box) {
    box = el("div", { id: `panel-${id}`, class: "panel" });
    box.append(el("h3", {}, title), el("div", { class: "chart" }));
    document.getElementById("panels").append(box);
  }
  return box;
}

const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];

function tick(v) {
  if (v === null) return "";
  return v !== 0 && Math.abs(v) < 1e-3 ? v.toExponential(0) : String(+v.toPrecision(3));
}

// a flat series gets a band around it instead of uPlot's 0..100
function yRange(u, min, max) {
  if (min === max) return [min - (Math.abs(min) || 1) * 0.5, max + (Math.abs(max) || 1) * 0.5];
  return uPlot.rangeNum(min, max, 0.1, true);
}

function draw(id, title, lines, log) {
  const box = panelBox(id, title);
  const chartDiv = box.querySelector(".chart");
  const { data, drawn } = aligned(lines);
  box.dataset.points = String(drawn);
  const useLog = log && drawn > 0 && data.slice(1).every((ys) => ys.every((v) => v === null || v > 0));
  const signature = JSON.stringify([lines.map((l) => l.label), useLog]);
  const known = charts.get(id);
  if (!drawn) {
    if (known) known.plot.destroy();
    charts.delete(id);
    chartDiv.replaceChildren(el("div", { class: "empty" }, "no data"));
    return;
  }
  if (known && known.signature === signature) {
    known.plot.setData(data);
    return;
  }
  if (known) known.plot.destroy();
  chartDiv.replaceChildren();
  const opts = {
    width: Math.max(chartDiv.clientWidth || 560, 300), height: 230,
    scales: { x: { time: false }, y: useLog ? { distr: 3 } : { range: yRange } },
    axes: [{ label: "step", incrs: STEP_INCRS }, { values: (u, splits) => splits.map(tick), size: 60 }],
    series: [{ label: "step" }, ...lines.map((l) => ({
      label: l.label, stroke: l.color, fill: l.fill, dash: l.dash, spanGaps: true,
      points: { show: data[0].length < 40 },
    }))],
  };
  charts.set(id, { plot: new uPlot(opts, data, chartDiv), signature });
}

function renderPanels() {
  const notes = [];
  for (const panel of PANELS) {
    const lines = curveLines(panel, notes);
    if (!lines.length && panel.optional) continue;
    if (!lines.some((l) => l.points.size) && runs.some((r) => r.byStep.size)) {
      notes.push(`${panel.title}: no run has data for it`);
    }
    draw(panel.id, panel.title, lines, panel.log);
  }
  for (const run of runs) {
    if (!run.byStep.size) continue;
    const lines = phaseLines(run);
    if (!lines.length) notes.push(`phase breakdown: ${run.label} has no perf/*_time_s`);
    draw(`phases-${run.id}`, `phase breakdown, seconds a step, stacked: ${run.label}`, lines);
  }
  return notes;
}

function renderText(notes) {
  const skipped = runs.flatMap((r) => r.skipped).concat(notes);
  const list = document.getElementById("skipped");
  list.replaceChildren(...skipped.map((s) => el("li", {}, s)));
  document.getElementById("notes").hidden = !skipped.length;
  const advice = runs.flatMap((r) => r.advice.map((a) => ({ run: r.label, ...a })))
    .sort((a, b) => b.last_step - a.last_step).slice(0, 20);
  const items = advice.map((a) => {
    const li = el("li", { "data-rule": a.rule });
    const span = a.first_step === a.last_step ? `step ${a.last_step}` : `steps ${a.first_step}–${a.last_step}`;
    li.append(el("span", { class: "rule" }, `${a.run}, ${span}: `), document.createTextNode(a.message));
    return li;
  });
  if (!items.length) items.push(el("li", {}, "no advice: every rule is quiet"));
  document.getElementById("advice").replaceChildren(...items);
  const heads = runs.map((r, i) => {
    const steps = [...r.byStep.keys()];
    const last = steps.length ? Math.max(...steps) : "none";
    const span = el("span", { class: "run-step", "data-run": String(r.id) });
    const swatch = el("span", { class: "swatch", style: `background:${COLORS[i % COLORS.length]}` });
    span.append(swatch, document.createTextNode(`${r.label}: step ${last}`));
    return span;
  });
  document.getElementById("runs").replaceChildren(...heads);
}

async function fetchJson(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: ${response.status}`);
  return response.json();
}

function renderSampleChoices() {
  const runSelect = document.getElementById("sample-run");
  if (runSelect.options.length !== runs.length) {
    runSelect.replaceChildren(...runs.map((r) => el("option", { value: String(r.id) }, r.label)));
  }
  const run = runs[Number(runSelect.value || 0)];
  const stepSelect = document.getElementById("sample-step");
  const steps = run ? run.sampleSteps : [];
  const chosen = stepSelect.value;
  if (stepSelect.options.length !== steps.length) {
    stepSelect.replaceChildren(...steps.map((s) => el("option", { value: String(s) }, String(s))));
    const keep = !sampleFollow && steps.includes(Number(chosen));
    stepSelect.value = keep ? chosen : String(steps.length ? steps[steps.length - 1] : "");
    if (stepSelect.value !== chosen) showSamples();
  }
}

function tokenSpan(piece, logprob, mask) {
  const span = el("span", { class: mask === 0 ? "tok masked" : "tok" }, piece);
  if (typeof logprob === "number") {
    const p = Math.exp(logprob);
    span.style.background = `hsl(${Math.round(120 * p)}, 70%, 82%)`;
    span.title = `log-prob ${logprob.toFixed(3)} (p ${p.toFixed(3)}), loss mask ${mask}`;
  } else {
    span.title = `no log-prob, loss mask ${mask}`;
  }
  return span;
}

function promptText(prompt) {
  if (Array.isArray(prompt)) return prompt.map((m) => `${m.role}: ${m.content}`).join("\n");
  return String(prompt);
}

async function showSamples() {
  const run = document.getElementById("sample-run").value;
  const step = document.getElementById("sample-step").value;
  const list = document.getElementById("sample-list");
  if (run === "" || step === "") {
    list.replaceChildren(el("p", {}, "no samples recorded (monitor.samples_per_step)"));
    return;
  }
  const answer = await fetchJson(`/api/samples/${run}?step=${step}`);
  list.replaceChildren(...answer.samples.map((s) => {
    const card = el("div", { class: "sample" });
    const reward = s.reward === null || s.reward === undefined ? "none" : s.reward;
    const meta = `step ${s.step} · group ${s.group} · sample ${s.index} · reward ${reward} · ` +
      `${s.status} · weight versions [${s.weight_versions.join(", ")}]` +
      (s.label !== null && s.label !== undefined ? ` · label ${s.label}` : "");
    const response = el("pre", { class: "response" });
    s.response_tokens.forEach((piece, t) => response.append(tokenSpan(piece, s.logprobs[t], s.loss_mask[t])));
    card.append(el("div", { class: "meta" }, meta), el("pre", { class: "prompt" }, promptText(s.prompt)), response);
    return card;
  }));
}

async function poll() {
  try {
    const updates = await Promise.all(runs.map((r) => fetchJson(`/api/run/${r.id}?cursor=${r.cursor}`)));
    updates.forEach((u, i) => merge(runs[i], u));
    renderText(renderPanels());
    renderSampleChoices();
    document.getElementById("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    document.getElementById("status").textContent = `cannot reach verst dashboard: ${error.message}`;
  }
  setTimeout(poll, POLL_MS);
}

async function start() {
  for (const r of await fetchJson("/api/runs")) {
    runs.push({ ...r, cursor: 0, byStep: new Map(), skipped: [], advice: [], sampleSteps: [] });
  }
  document.getElementById("sample-run").addEventListener("change", () => {
    document.getElementById("sample-step").replaceChildren();
    sampleFollow = true;
    renderSampleChoices();
  });
  document.getElementById("sample-step").addEventListener("change", () => {
    sampleFollow = false;
    showSamples();
  });
  poll();
}

start();
