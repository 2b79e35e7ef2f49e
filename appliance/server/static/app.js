// The omlx dashboard: every read and every action is a call to /admin/api/. No framework:
// tabs, a one-second poll, tables rebuilt from each answer, and small canvas charts.
"use strict";

const KEY = "omlx.adminKey";
const POLL_MS = 1000;
const HISTORY_S = 300;
const $ = (id) => document.getElementById(id);
const history = [];  // {t, tokS, p50, p95, running, queued}
let last = null;     // the previous overview, to turn totals into rates
let tab = "overview";
let configLoaded = false;

// ---- the admin API, with the admin key when the server asks for one ----

let keyWaiters = null;

function askKey() {
  if (!keyWaiters) {
    keyWaiters = [];
    const dialog = $("key-dialog");
    dialog.showModal();
    $("key-input").focus();
  }
  return new Promise((resolve) => keyWaiters.push(resolve));
}

$("key-form").addEventListener("submit", () => {
  sessionStorage.setItem(KEY, $("key-input").value);
  $("key-input").value = "";
  const waiters = keyWaiters || [];
  keyWaiters = null;
  waiters.forEach((resolve) => resolve());
});

async function api(method, path, body) {
  for (;;) {
    const headers = {};
    const key = sessionStorage.getItem(KEY);
    if (key) headers["Authorization"] = "Bearer " + key;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch("/admin/api/" + path, {
      method, headers, body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (response.status === 401) {
      sessionStorage.removeItem(KEY);
      await askKey();
      continue;
    }
    const data = await response.json().catch(() => ({}));
    return {status: response.status, data};
  }
}

// ---- tabs: buttons, arrow keys, and 1-4 anywhere outside the editor ----

const TABS = ["overview", "models", "cache", "config"];

function show(name, focus) {
  tab = name;
  for (const t of TABS) {
    const button = $("tab-" + t);
    const selected = t === name;
    button.setAttribute("aria-selected", String(selected));
    button.tabIndex = selected ? 0 : -1;
    $(t).hidden = !selected;
    if (selected && focus) button.focus();
  }
  if (name === "config" && !configLoaded) loadConfig();
  refresh();
}

for (const t of TABS) $("tab-" + t).addEventListener("click", () => show(t, false));
document.querySelector("[role=tablist]").addEventListener("keydown", (e) => {
  const step = {ArrowRight: 1, ArrowLeft: -1}[e.key];
  if (step) show(TABS[(TABS.indexOf(tab) + step + TABS.length) % TABS.length], true);
});
document.addEventListener("keydown", (e) => {
  if (e.target.tagName === "TEXTAREA" || e.target.tagName === "INPUT") {
    if ((e.ctrlKey || e.metaKey) && e.key === "s" && e.target.id === "config-text") {
      e.preventDefault();
      saveConfig();
    }
    return;
  }
  const n = Number(e.key);
  if (n >= 1 && n <= TABS.length && !e.ctrlKey && !e.metaKey && !e.altKey) show(TABS[n - 1], true);
});

// ---- formatting ----

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}
const num = (v, digits = 2) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));
const ms = (s) => (s === null || s === undefined ? "–" : (s * 1000).toFixed(0) + " ms");

function cell(row, content) {
  const td = document.createElement("td");
  if (content instanceof Node) td.appendChild(content); else td.textContent = content ?? "–";
  row.appendChild(td);
  return td;
}

function fillRows(tbody, items, build) {
  tbody.replaceChildren(...items.map((item) => {
    const tr = document.createElement("tr");
    build(tr, item);
    return tr;
  }));
}

function stateCell(row, state) {
  cell(row, state).className = "state-" + state;
}

function notice(text) {
  const el = $("notice");
  el.textContent = text;
  el.hidden = !text;
}

function showConfigError(err) {
  const el = $("config-error");
  el.hidden = !err;
  el.textContent = err ? `Config not applied${err.path ? " (" + err.path + ")" : ""}: ${err.message}` : "";
}

// ---- Overview ----

async function refreshOverview() {
  const {status, data} = await api("GET", "overview");
  if (status !== 200) return;
  $("up-since").textContent = new Date(data.started_at * 1000).toLocaleString();
  $("backend").textContent = data.backend;
  $("config-hash").textContent = data.config.hash;
  showConfigError(data.config.last_error);
  let tokS = null;
  if (last && data.time > last.time) tokS = Math.max(0, (data.output_tokens - last.output_tokens) / (data.time - last.time));
  last = data;
  $("tok-s").textContent = tokS === null ? "–" : tokS.toFixed(1);
  $("ttft").textContent = ms(data.ttft_p50_s) + " / " + ms(data.ttft_p95_s);
  $("load").textContent = data.running + " / " + data.queued;
  fillRows($("overview-models").tBodies[0], data.models, (tr, m) => {
    cell(tr, m.name + (m.default ? " (default)" : ""));
    stateCell(tr, m.state);
    cell(tr, bytes(m.weights_bytes));
    cell(tr, String(m.running));
    cell(tr, String(m.queued));
  });
  history.push({t: data.time, tokS, p50: data.ttft_p50_s, p95: data.ttft_p95_s, running: data.running, queued: data.queued});
  while (history.length && history[0].t < data.time - HISTORY_S) history.shift();
  if (tab === "overview") {
    chart($("chart-tok"), [history.map((h) => [h.t, h.tokS])]);
    chart($("chart-ttft"), [history.map((h) => [h.t, h.p50]), history.map((h) => [h.t, h.p95])]);
    chart($("chart-load"), [history.map((h) => [h.t, h.running]), history.map((h) => [h.t, h.queued])]);
  }
}

function chart(canvas, series) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 28;
  ctx.clearRect(0, 0, w, h);
  const now = Date.now() / 1000;
  const values = series.flat().map((p) => p[1]).filter((v) => v !== null && v !== undefined);
  const top = Math.max(1e-9, ...values) * 1.1 || 1;
  ctx.strokeStyle = "#dde1e8";
  ctx.fillStyle = "#6b7385";
  ctx.font = "11px system-ui";
  ctx.beginPath(); ctx.moveTo(pad, 4); ctx.lineTo(pad, h - pad / 2); ctx.lineTo(w - 4, h - pad / 2); ctx.stroke();
  ctx.fillText(top >= 10 ? top.toFixed(0) : top.toPrecision(2), 2, 12);
  ctx.fillText("0", 2, h - pad / 2);
  const x = (t) => pad + (w - pad - 4) * (1 - (now - t) / HISTORY_S);
  const y = (v) => h - pad / 2 - (h - pad / 2 - 8) * (v / top);
  ["#2f6fdb", "#e0782f"].forEach((color, i) => {
    const points = (series[i] || []).filter((p) => p[1] !== null && p[1] !== undefined);
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    points.forEach(([t, v], j) => (j ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
    ctx.stroke();
  });
}

// ---- Models ----

async function refreshModels() {
  const {status, data} = await api("GET", "models");
  if (status !== 200) return;
  fillRows($("model-table").tBodies[0], data.models, (tr, m) => {
    tr.dataset.model = m.name;
    cell(tr, m.name);
    stateCell(tr, m.state);
    cell(tr, m.default ? "yes" : "");
    cell(tr, m.source);
    cell(tr, m.context_tokens ? String(m.context_tokens) : "–");
    cell(tr, num(m.load_s));
    cell(tr, m.live_requests === undefined ? "–" : String(m.live_requests));
    const actions = document.createElement("span");
    if (m.state === "unloaded") {
      actions.append(actionButton("Load", m.name, "load"));
    } else {
      actions.append(actionButton("Unload", m.name, "unload"));
      if (!m.default) actions.append(actionButton("Make default", m.name, "default"));
    }
    cell(tr, actions);
  });
}

function actionButton(label, name, verb) {
  const button = document.createElement("button");
  button.type = "button";
  button.textContent = label;
  button.dataset.action = verb;
  button.setAttribute("aria-label", `${label} ${name}`);
  button.addEventListener("click", async () => {
    document.querySelectorAll("#model-table button").forEach((b) => (b.disabled = true));
    notice(`${label}: ${name}…`);
    const {status, data} = await api("POST", `models/${encodeURIComponent(name)}/${verb}`);
    notice(status === 200 ? `${label} ${name}: applied (${(data.actions || []).join("; ") || "no change"})`
      : `${label} ${name} failed: ${(data.error && data.error.message) || (data.last_error && data.last_error.message) || status}`);
    await refresh();
  });
  return button;
}

// ---- Cache ----

async function refreshCache() {
  const {status, data} = await api("GET", "cache");
  if (status !== 200) return;
  const tiers = Object.entries(data.tiers || {});
  fillRows($("tier-table").tBodies[0], tiers, (tr, [name, t]) => {
    cell(tr, name + (t.disabled ? " (disabled)" : ""));
    cell(tr, `${bytes(t.bytes)} / ${bytes(t.budget_bytes)}`);
    const bar = document.createElement("div");
    bar.className = "bar";
    const fill = document.createElement("span");
    fill.style.width = (t.budget_bytes ? Math.min(100, 100 * (t.bytes || 0) / t.budget_bytes) : 0) + "%";
    bar.appendChild(fill);
    cell(tr, bar);
    cell(tr, t.blocks ?? "–");
    cell(tr, t.hits ?? "–");
    const restored = last && last.prompt_tokens ? (last.cached_tokens_by_tier[name] || 0) / last.prompt_tokens : null;
    cell(tr, restored === null ? "–" : (100 * restored).toFixed(1) + "%");
    cell(tr, t.evictions ?? "–");
    cell(tr, num(t.restore_gbps));
  });
  const misses = tiers.flatMap(([name, t]) => Object.entries(t.misses || {}).map(([why, n]) => `${name}: ${why} ${n}`));
  $("misses").replaceChildren(...(misses.length ? misses : ["none"]).map((text) => {
    const li = document.createElement("li");
    li.textContent = text;
    return li;
  }));
  fillRows($("cache-models").tBodies[0], Object.entries(data.models || {}), (tr, [name, m]) => {
    cell(tr, name);
    cell(tr, m.lookups ?? 0);
    cell(tr, m.hits ?? 0);
    cell(tr, m.misses ?? 0);
    cell(tr, m.hit_ratio === null || m.hit_ratio === undefined ? "–" : (100 * m.hit_ratio).toFixed(1) + "%");
    cell(tr, m.saved_blocks ?? 0);
  });
}

$("clear-cache").addEventListener("click", async () => {
  if (!confirm("Remove every cached KV block?")) return;
  const {status, data} = await api("POST", "cache/clear");
  notice(status === 200 ? `cache cleared: ${data.removed_blocks} blocks removed` : `clear failed: ${status}`);
  refresh();
});

// ---- Config ----

async function loadConfig() {
  const {status, data} = await api("GET", "config/file");
  if (status !== 200) return;
  configLoaded = true;
  $("config-path").textContent = data.path;
  $("config-text").value = data.text;
  $("config-issues").replaceChildren();
}

async function saveConfig() {
  $("config-save").disabled = true;
  const {status, data} = await api("PUT", "config/file", {text: $("config-text").value});
  $("config-save").disabled = false;
  const issues = status === 400 && data.error ? (data.error.issues || [{path: "", message: data.error.message}])
    : status === 409 && data.last_error ? [{path: data.last_error.path || "", message: data.last_error.message}] : [];
  showIssues(issues);
  if (status === 200) notice(`config applied (${(data.actions || []).join("; ") || "no change"})`);
  refresh();
}

function showIssues(issues) {
  $("config-issues").replaceChildren(...issues.map((issue) => {
    const li = document.createElement("li");
    if (issue.path) {
      const link = document.createElement("a");
      link.href = "#";
      link.textContent = issue.path;
      link.addEventListener("click", (e) => { e.preventDefault(); jumpTo(issue.path); });
      li.append(link, ": ");
    }
    li.append(issue.message);
    return li;
  }));
}

function jumpTo(path) {
  // The TOML path's last key, e.g. "port" of "server.port": select its line in the editor.
  const key = path.replace(/\[\d+\]$/, "").split(".").pop().replace(/\[\d+\]/, "");
  const area = $("config-text");
  const match = new RegExp("^\\s*" + key.replace(/[.*+?^${}()|[\]\\]/g, "\\$&") + "\\s*=", "m").exec(area.value);
  area.focus();
  if (match) area.setSelectionRange(match.index, area.value.indexOf("\n", match.index));
}

$("config-save").addEventListener("click", saveConfig);
$("config-reload").addEventListener("click", loadConfig);

// ---- the poll ----

async function refresh() {
  try {
    await refreshOverview();
    if (tab === "models") await refreshModels();
    if (tab === "cache") await refreshCache();
    $("conn").textContent = "live";
  } catch (e) {
    $("conn").textContent = "no answer from the server";
  }
}

async function poll() {
  await refresh();
  setTimeout(poll, POLL_MS);
}

poll();
