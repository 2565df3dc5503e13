// The spotrl dashboard: reads the coordinator's API and draws the chosen run with uPlot.
// State lives in `window.spotrlDashboard` so that a person (or the browser test) can inspect it.
"use strict";

const params = new URLSearchParams(location.search);
const REFRESH_MS = Number(params.get("refresh_ms")) || 2000;
const COLORS = { reserved: "#3b6fd8", preemptible: "#e07b22", third: "#2f8f4e", fourth: "#8e44ad" };
const FINAL = new Set(["succeeded", "failed", "cancelled"]);

const state = {
  runId: params.get("run"),
  token: localStorage.getItem("spotrlToken") || "",
  charts: {},
  points: {},
  refreshes: 0,
  timeline: { runId: null, events: [], pool: [], afterEvent: null, afterSample: null },
};
window.spotrlDashboard = state;

const $ = (id) => document.getElementById(id);
const fmt = (x, digits = 2) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));

async function api(path) {
  const headers = state.token ? { Authorization: "Bearer " + state.token } : {};
  const resp = await fetch(path, { headers });
  if (resp.status === 401) {
    $("auth").hidden = false;
    throw new Error("the API wants a token");
  }
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
  return resp.json();
}

// ---- data shaping (pure) ----
function perStep(rows, ...fields) {
  const done = rows.filter((r) => r.reward_mean !== undefined);
  return [done.map((r) => r.step), ...fields.map((f) => done.map((r) => r[f] ?? null))];
}

function migrationCauses(rows) {
  const causes = new Set();
  rows.forEach((r) => Object.keys(r.migrations || {}).forEach((c) => causes.add(c)));
  return [...causes].sort();
}

function churnData(rows, events) {
  const done = rows.filter((r) => r.reward_mean !== undefined);
  const steps = done.map((r) => r.step);
  const preempted = new Map();
  events
    .filter((e) => e.kind === "worker_left" && e.step !== null && e.step !== undefined)
    .forEach((e) => preempted.set(e.step, (preempted.get(e.step) || 0) + 1));
  const causes = migrationCauses(done);
  const series = causes.map((c) => done.map((r) => (r.migrations || {})[c] || 0));
  return { causes, data: [steps, steps.map((s) => preempted.get(s) || 0), ...series] };
}

function poolData(samples, events) {
  const left = events.filter((e) => e.kind === "worker_left").map((e) => e.at);
  const xs = samples.map((s) => s.at);
  const gone = xs.map((t) => left.filter((a) => a <= t).length);
  const reserved = samples.map((s) => s.workers.reserved);
  const preemptible = samples.map((s) => s.workers.preemptible);
  const tps = samples.map((s) => s.tokens_per_s.reserved + s.tokens_per_s.preemptible);
  return [xs, reserved, preemptible, gone, tps];
}

function countPoints(data) {
  return data.slice(1).reduce((n, ys) => n + ys.filter((y) => y !== null).length, 0);
}

// ---- charts ----
function line(label, stroke, extra = {}) {
  return { label, stroke, width: 2, points: { show: true, size: 5 }, ...extra };
}

function draw(name, series, data, { time = false, axes = null, scales = {} } = {}) {
  const el = $("chart-" + name);
  const n = countPoints(data);
  state.points[name] = n;
  el.dataset.points = String(n);
  if (n === 0) {
    if (state.charts[name]) state.charts[name].destroy();
    delete state.charts[name];
    el.innerHTML = '<div class="empty">no data yet</div>';
    return;
  }
  const chart = state.charts[name];
  if (chart && chart.series.length === series.length + 1) {
    chart.setData(data);
    return;
  }
  if (chart) chart.destroy();
  el.innerHTML = "";
  const opts = {
    width: Math.max(300, el.clientWidth || 560),
    height: 240,
    scales: { x: { time }, ...scales },
    series: [{ label: time ? "time" : "step" }, ...series],
    axes: axes || [{}, {}],
    legend: { live: false },
  };
  state.charts[name] = new uPlot(opts, data, el);
}

function render(run, rows, tl) {
  const stepped = uPlot.paths.stepped({ align: 1 });
  draw("reward", [line("reward (mean)", COLORS.reserved)], perStep(rows, "reward_mean"));
  draw("throughput", [line("tokens/s", COLORS.preemptible)], perStep(rows, "tokens_per_s"));
  draw(
    "pool",
    [
      line("reserved", COLORS.reserved, { paths: stepped, points: { show: false } }),
      line("preemptible", COLORS.preemptible, { paths: stepped, points: { show: false } }),
      line("workers left (cumulative)", "#b43b3b", { paths: stepped, points: { show: false }, dash: [4, 4] }),
      line("tokens/s", "#98a2b3", { scale: "tps", points: { show: false }, width: 1 }),
    ],
    poolData(tl.pool, tl.events),
    {
      time: true,
      scales: { tps: {} },
      axes: [{}, { label: "workers" }, { scale: "tps", side: 1, label: "tokens/s", grid: { show: false } }],
    },
  );
  const churn = churnData(rows, tl.events);
  const palette = [COLORS.preemptible, COLORS.reserved, COLORS.third, COLORS.fourth];
  draw(
    "churn",
    [
      line("workers left", "#b43b3b"),
      ...churn.causes.map((c, i) => line(`migrated: ${c}`, palette[i % palette.length])),
    ],
    churn.data,
  );
  draw(
    "tseed",
    [line("T_seed (window)", COLORS.reserved), line("seeding took", COLORS.third)],
    perStep(rows, "t_seed_s", "seed_s"),
  );
  draw(
    "trainer",
    [
      line("whole step", "#344054"),
      line("rollout", COLORS.preemptible),
      line("trainer waiting", "#b43b3b", { dash: [4, 4] }),
      line("train compute", COLORS.reserved),
      line("checkpoint", COLORS.fourth),
      line("publish", COLORS.third),
    ],
    perStep(rows, "step_s", "rollout_s", "train_wait_s", "train_compute_s", "checkpoint_s", "publish_s"),
  );
  draw(
    "redis",
    [
      line("used (MiB)", COLORS.reserved, { points: { show: false } }),
      line("limit (MiB)", "#b43b3b", { points: { show: false }, dash: [4, 4] }),
      line("deltas", COLORS.preemptible, { scale: "len", points: { show: false }, width: 1 }),
      line("groups", COLORS.third, { scale: "len", points: { show: false }, width: 1 }),
    ],
    redisData(tl.pool),
    {
      time: true,
      scales: { len: {} },
      axes: [{}, { label: "MiB" }, { scale: "len", side: 1, label: "entries", grid: { show: false } }],
    },
  );
  renderSummary(run, rows, tl);
  renderEvents(tl.events);
}

// Redis memory and the run's stream lengths from the pool samples (older samples lack them)
function redisData(samples) {
  const withMem = samples.filter((s) => s.redis_mem_mib !== undefined);
  return [
    withMem.map((s) => s.at),
    withMem.map((s) => s.redis_mem_mib),
    withMem.map((s) => (s.redis_limit_mib > 0 ? s.redis_limit_mib : null)),
    withMem.map((s) => (s.streams ? s.streams.deltas : null)),
    withMem.map((s) => (s.streams ? s.streams.groups : null)),
  ];
}

function renderSummary(run, rows, tl) {
  $("s-state").textContent = run.paused_at ? `${run.state} (paused)` : run.state;
  $("s-state").className = "value " + run.state;
  $("s-quarantined").textContent = String(run.groups_quarantined || 0);
  renderStall(run);
  $("s-step").textContent = `${run.step} / ${run.steps}`;
  $("s-progress").style.width = `${Math.min(100, (100 * run.step) / Math.max(1, run.steps))}%`;
  $("s-reward").textContent = fmt(run.reward_mean, 3);
  $("s-tps").textContent = fmt(run.tokens_per_s, 0);
  const last = tl.pool[tl.pool.length - 1];
  $("s-workers").textContent = last ? `${last.workers.reserved} / ${last.workers.preemptible}` : "–";
  const left = tl.events.filter((e) => e.kind === "worker_left");
  const lost = left.filter((e) => e.cause === "lost").length;
  $("s-preempt").textContent = `${left.length} (${lost} lost)`;
  const migrated = rows.reduce(
    (n, r) => n + Object.values(r.migrations || {}).reduce((a, b) => a + b, 0),
    0,
  );
  $("s-migr").textContent = String(migrated);
  $("s-tseed").textContent = run.t_seed_s === null ? "∞" : `${fmt(run.t_seed_s)} s`;
  renderEpisodes(rows);
  renderDrafts(rows);
  renderVersionSize(run, rows);
  renderErrors(run);
  const mem = tl.pool.filter((s) => s.redis_mem_mib !== undefined).pop();
  $("s-redis").textContent = mem
    ? `${fmt(mem.redis_mem_mib, 0)}${mem.redis_limit_mib > 0 ? ` / ${fmt(mem.redis_limit_mib, 0)}` : ""}`
    : "–";
}

// a multi-turn run (an environment): the last step's turns per episode, the run's tool calls
// and environment time; hidden for a single-turn run
function renderEpisodes(rows) {
  const episodic = rows.filter((r) => r.turns_mean !== undefined && r.turns_mean !== null);
  $("c-episodes").hidden = episodic.length === 0;
  if (!episodic.length) return;
  const last = episodic[episodic.length - 1];
  const calls = episodic.reduce((n, r) => n + (r.tool_calls || 0), 0);
  const envS = episodic.reduce((n, r) => n + (r.environment_s || 0), 0);
  $("s-episodes").textContent = `${fmt(last.turns_mean, 2)} / ${calls} / ${fmt(envS, 1)} s`;
}

// speculative decoding (steps where a draft was verified): the run's accepted and drafted
// tokens, and the last such step's accepted tokens per forward pass; hidden when none was
// the bytes of the newest version the trainer committed: the whole model, or in a LoRA run the
// adapter alone (what a worker pulls per version; the base comes once)
function renderVersionSize(run, rows) {
  const sized = rows.filter((r) => r.version_bytes !== undefined && r.version_bytes !== null);
  if (!sized.length) return;
  const bytes = sized[sized.length - 1].version_bytes;
  const mb = bytes >= 1e6 ? `${fmt(bytes / 1e6, 1)} MB` : `${fmt(bytes / 1e3, 0)} kB`;
  const lora = run.spec && run.spec.lora && run.spec.lora.use_peft;
  $("s-version").textContent = lora ? `${mb} (LoRA adapter, r ${run.spec.lora.lora_r})` : mb;
}

function renderDrafts(rows) {
  const drafted = rows.filter((r) => r.drafted_tokens !== undefined && r.drafted_tokens !== null);
  $("c-drafts").hidden = drafted.length === 0;
  if (!drafted.length) return;
  const accepted = drafted.reduce((n, r) => n + r.accepted_tokens, 0);
  const all = drafted.reduce((n, r) => n + r.drafted_tokens, 0);
  const last = drafted[drafted.length - 1];
  $("s-drafts").textContent = `${accepted} / ${all}, ${fmt(last.accepted_per_forward, 2)}`;
}

// failed calls of the run's user code by kind (environment step(), reward): failed/calls and
// the share, as the API counts them; the card turns to a warning when any failed
function renderErrors(run) {
  const errors = run.errors || {};
  const part = (c) => (c && c.calls ? `${c.failed}/${c.calls} (${fmt(100 * c.share, 1)}%)` : "–");
  $("s-errors").textContent = `${part(errors.environment)} / ${part(errors.reward)}`;
  $("c-errors").classList.toggle("warn", run.health !== undefined && run.health !== "ok");
  $("c-errors").title = run.health_reason || "";
}

// why a run cannot progress (stalled) or why it failed, in words
function renderStall(run) {
  const el = $("stall");
  let text = "";
  if (run.state === "stalled") {
    const since = run.stalled_since ? ` since ${new Date(run.stalled_since * 1000).toLocaleTimeString()}` : "";
    text = `stalled${since}: ${run.stall_reason}`;
  } else if (run.state === "failed" && run.error) {
    text = `failed: ${run.error}`;
  } else if (run.paused_at) {
    const since = new Date(run.paused_at * 1000).toLocaleTimeString();
    text = `paused since ${since}: no new step opens until it is resumed (spotrl resume ${run.id})`;
  } else if (run.health === "degraded") {
    text = `degraded: ${run.health_reason}`;
  }
  el.textContent = text;
  el.hidden = !text;
}

// a table row of text cells (textContent: ids and errors are never parsed as HTML)
function appendRow(body, cells) {
  const tr = document.createElement("tr");
  cells.forEach((text) => {
    const td = document.createElement("td");
    td.textContent = text;
    tr.appendChild(td);
  });
  body.appendChild(tr);
  return tr;
}

function renderWorkers(workers) {
  const body = $("workers").querySelector("tbody");
  body.innerHTML = "";
  workers.forEach((w) => {
    const error = w.last_error || "";
    const cells = [w.id, w.pool, w.alive ? "yes" : "no", w.version ?? "–", String(w.active), error];
    const tr = appendRow(body, cells);
    if (error) tr.cells[5].className = "error-text";
  });
}

function renderEvents(events) {
  const body = $("events").querySelector("tbody");
  body.innerHTML = "";
  events.slice(-40).reverse().forEach((e) => {
    const details = Object.entries(e)
      .filter(([k]) => !["id", "at", "kind"].includes(k))
      .map(([k, v]) => `${k}=${typeof v === "number" && !Number.isInteger(v) ? v.toFixed(3) : v}`)
      .join("  ");
    appendRow(body, [new Date(e.at * 1000).toLocaleTimeString(), e.kind, details]);
  });
}

// the fleet card's figures (pure), from GET /v1/fleet and GET /v1/workers: per active run its
// share, its fair part (share / the shares' sum) and its use (its active requests / the fleet's);
// for the fleet its alive workers, their slots and active requests, and the busy fraction
// (alive workers with a request now / alive workers). A fraction with nothing under it is null.
function fleetFigures(fleet, workers) {
  const alive = workers.filter((w) => w.alive);
  const active = alive.reduce((n, w) => n + w.active, 0);
  const runs = fleet.runs || [];
  const shares = runs.reduce((n, r) => n + r.share, 0);
  return {
    runs: runs.map((r) => ({
      ...r,
      fair: shares > 0 ? r.share / shares : null,
      use: active > 0 ? r.active / active : null,
    })),
    alive: alive.length,
    slots: alive.reduce((n, w) => n + w.slots, 0),
    active,
    busy: alive.length ? alive.filter((w) => w.active > 0).length / alive.length : null,
  };
}

const pct = (x) => (x === null ? "–" : `${fmt(100 * x, 0)}%`);

function renderFleet(figures) {
  const busy = figures.busy === null ? "–" : `${pct(figures.busy)} of the workers busy`;
  $("fleet-total").textContent =
    `fleet: ${figures.alive} alive workers, ${figures.slots} slots, ` +
    `${figures.active} active requests, ${busy}`;
  const n = figures.runs.length;
  $("fleet-note").textContent = n === 0 ? "no run active" : "one run active: the fleet is its own";
  $("fleet-note").hidden = n > 1;
  const body = $("fleet-runs").querySelector("tbody");
  body.innerHTML = "";
  figures.runs.forEach((r) => {
    const counts = [r.workers, r.slots, r.active].map(String);
    const cells = [r.id, fmt(r.share, 1), pct(r.fair), ...counts, pct(r.use)];
    const use = appendRow(body, cells).cells[6];
    use.className = "use";
    const bar = document.createElement("div");
    bar.className = "bar";
    const fill = bar.appendChild(document.createElement("div"));
    fill.style.width = `${Math.min(100, 100 * (r.use || 0))}%`;
    use.appendChild(bar);
  });
}

// ---- polling ----
async function fetchTimeline(runId) {
  const tl = state.timeline;
  if (tl.runId !== runId) Object.assign(tl, { runId, events: [], pool: [], afterEvent: null, afterSample: null });
  const q = new URLSearchParams();
  if (tl.afterEvent) q.set("after_event", tl.afterEvent);
  if (tl.afterSample) q.set("after_sample", tl.afterSample);
  const fresh = await api(`/v1/runs/${encodeURIComponent(runId)}/timeline?${q}`);
  tl.events.push(...fresh.events);
  tl.pool.push(...fresh.pool);
  if (fresh.events.length) tl.afterEvent = fresh.events[fresh.events.length - 1].id;
  if (fresh.pool.length) tl.afterSample = fresh.pool[fresh.pool.length - 1].id;
  return tl;
}

function chooseRun(runs) {
  if (state.runId && runs.some((r) => r.id === state.runId)) return state.runId;
  const running = runs.find((r) => r.state === "running" || r.state === "stalled");
  return running ? running.id : runs.length ? runs[0].id : null;
}

function fillSelect(runs) {
  const select = $("run-select");
  const wanted = runs.map((r) => `${r.id}|${r.state}|${r.step}`).join(",");
  if (select.dataset.key === wanted) return;
  select.dataset.key = wanted;
  select.innerHTML = "";
  runs.forEach((r) => {
    const opt = document.createElement("option");
    opt.value = r.id;
    opt.textContent = `${r.id} — ${r.state} (${r.step}/${r.steps})`;
    opt.selected = r.id === state.runId;
    select.appendChild(opt);
  });
}

async function refresh() {
  let finalRun = false;
  try {
    const health = await fetch("/healthz").then((r) => r.json()).catch(() => ({ ok: false }));
    $("health").textContent = health.ok ? "healthy" : "unhealthy";
    $("health").className = "pill " + (health.ok ? "ok" : "bad");
    const runs = await api("/v1/runs?limit=50");
    state.runId = chooseRun(runs);
    fillSelect(runs);
    const run = runs.find((r) => r.id === state.runId);
    const [workers, fleet] = await Promise.all([api("/v1/workers"), api("/v1/fleet")]);
    renderWorkers(workers);
    renderFleet(fleetFigures(fleet, workers));
    if (run) {
      const [metrics, tl] = await Promise.all([
        api(`/v1/runs/${encodeURIComponent(run.id)}/metrics`),
        fetchTimeline(run.id),
      ]);
      render(run, metrics.steps, tl);
      finalRun = FINAL.has(run.state);
    }
    state.refreshes += 1;
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    $("error").hidden = true;
  } catch (err) {
    $("error").textContent = String(err);
    $("error").hidden = false;
  }
  // a finished run changes no more: look for new runs, slowly
  schedule(finalRun ? 5 * REFRESH_MS : REFRESH_MS);
}

let timer = null;
function schedule(ms) {
  clearTimeout(timer);
  timer = setTimeout(refresh, ms);
}

$("run-select").addEventListener("change", (e) => {
  state.runId = e.target.value;
  const url = new URL(location.href);
  url.searchParams.set("run", state.runId);
  history.replaceState(null, "", url);
  schedule(0);
});
$("token-save").addEventListener("click", () => {
  state.token = $("token").value.trim();
  localStorage.setItem("spotrlToken", state.token);
  $("auth").hidden = true;
  schedule(0);
});
window.addEventListener("resize", () => {
  Object.values(state.charts).forEach((c) => {
    const el = c.root.parentElement;
    c.setSize({ width: Math.max(300, el.clientWidth), height: 240 });
  });
});
schedule(0);
