// Live charts of this server's /metrics, per model: scraped every 2 s (`?every_s=0.5`:
// every half second) from this page's own origin, rates and quantiles computed here from
// consecutive scrapes (as Prometheus's rate() and histogram_quantile() would), drawn with
// the vendored uPlot. No request leaves for another host.
"use strict";

// Seconds between scrapes: 2, or the page's `?every_s=` when it is at least 0.25.
const EVERY_S = Number(new URLSearchParams(location.search).get("every_s"));
const SCRAPE_MS = 1000 * (EVERY_S >= 0.25 ? EVERY_S : 2);
const KEEP_POINTS = 300; // 10 minutes at 2 s

// Prometheus text format -> Map(name -> [{labels, value}]).
function parseMetrics(text) {
  const families = new Map();
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const match = line.match(/^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)/);
    if (!match) continue;
    const labels = {};
    if (match[3]) {
      for (const pair of match[3].matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
    }
    if (!families.has(match[1])) families.set(match[1], []);
    families.get(match[1]).push({ labels, value: parseFloat(match[4]) });
  }
  return families;
}

// Sum a family's samples by model (optionally by a label filter).
function byModel(families, name, keep = () => true) {
  const out = {};
  for (const s of families.get(name) || []) {
    if (!keep(s.labels)) continue;
    const model = s.labels.model || "server";
    out[model] = (out[model] || 0) + s.value;
  }
  return out;
}

// Histogram buckets by model: {model: [[le, count], ...]} summed over versions.
function buckets(families, name) {
  const out = {};
  for (const s of families.get(name + "_bucket") || []) {
    const model = s.labels.model || "server";
    const le = s.labels.le === "+Inf" ? Infinity : parseFloat(s.labels.le);
    out[model] = out[model] || new Map();
    out[model].set(le, (out[model].get(le) || 0) + s.value);
  }
  return out;
}

function quantile(q, now, before) {
  const les = [...now.keys()].sort((a, b) => a - b);
  const counts = les.map((le) => now.get(le) - ((before && before.get(le)) || 0));
  const total = counts[counts.length - 1];
  if (!(total > 0)) return null;
  const rank = q * total;
  for (let i = 0; i < les.length; i++) {
    if (counts[i] >= rank) {
      if (les[i] === Infinity) return les[i - 1] || null;
      const lower = i ? les[i - 1] : 0;
      const below = i ? counts[i - 1] : 0;
      const inBucket = counts[i] - below;
      return lower + (les[i] - lower) * (inBucket > 0 ? (rank - below) / inBucket : 0);
    }
  }
  return null;
}

// What each chart plots: a function of (this scrape, the last one, seconds between).
const CHARTS = [
  ["Requests per second", (n, p, dt) => rates(n, p, dt, "slipstream_request_success_total")],
  ["Failures per second", (n, p, dt) => rates(n, p, dt, "slipstream_request_failure_total")],
  ["Latency p99 (ms)", (n, p) => quantiles(n, p, "slipstream_request_duration_seconds", 0.99, 1000)],
  ["Latency p50 (ms)", (n, p) => quantiles(n, p, "slipstream_request_duration_seconds", 0.5, 1000)],
  ["Queue time p99 (ms)", (n, p) => quantiles(n, p, "slipstream_queue_duration_seconds", 0.99, 1000)],
  ["Rows per batch", (n, p) => ratio(n, p, "slipstream_batch_size_sum", "slipstream_batch_size_count")],
  ["Compute utilization", (n, p, dt) => rates(n, p, dt, "slipstream_compute_duration_seconds_sum")],
  ["Cost per million inferences", (n) => byModel(n, "slipstream_cost_per_million_inferences")],
  ["Drift: smallest p-value", (n) => minByModel(n, "slipstream_drift_p_value")],
  ["LLM tokens per second", (n, p, dt) => rates(n, p, dt, "slipstream_llm_generation_tokens_total")],
  ["LLM time to first token p50 (ms)", (n, p) => quantiles(n, p, "slipstream_llm_time_to_first_token_seconds", 0.5, 1000)],
  ["LLM KV cache blocks held", (n) => byModel(n, "slipstream_llm_kv_cache_blocks_used")],
];

function rates(now, before, dt, name) {
  if (!before || !(dt > 0)) return {};
  const a = byModel(now, name), b = byModel(before, name), out = {};
  for (const m in a) out[m] = Math.max(0, a[m] - (b[m] || 0)) / dt;
  return out;
}

function ratio(now, before, sum, count) {
  if (!before) return {};
  const s1 = byModel(now, sum), s0 = byModel(before, sum);
  const c1 = byModel(now, count), c0 = byModel(before, count), out = {};
  for (const m in s1) {
    const dc = c1[m] - (c0[m] || 0);
    if (dc > 0) out[m] = (s1[m] - (s0[m] || 0)) / dc;
  }
  return out;
}

function quantiles(now, before, name, q, scale) {
  if (!before) return {};
  const a = buckets(now, name), b = buckets(before, name), out = {};
  for (const m in a) {
    const v = quantile(q, a[m], b[m]);
    if (v !== null) out[m] = v * scale;
  }
  return out;
}

function minByModel(families, name) {
  const out = {};
  for (const s of families.get(name) || []) {
    const m = s.labels.model || "server";
    out[m] = Math.min(out[m] === undefined ? Infinity : out[m], s.value);
  }
  return out;
}

const state = { times: [], charts: CHARTS.map(([title, fn]) => ({ title, fn, series: {}, plot: null })),
                last: null, lastAt: 0, scrapes: 0, drawn: 0 };
window.slipstreamDashboard = state;

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

function draw(chart) {
  const models = Object.keys(chart.series).sort();
  const data = [state.times, ...models.map((m) => chart.series[m])];
  if (!models.length) return;
  if (!chart.plot || chart.plot.series.length !== models.length + 1) {
    if (chart.plot) chart.plot.destroy();
    const box = chart.box;
    chart.plot = new uPlot({
      width: box.clientWidth || 460, height: 220,
      series: [{}, ...models.map((m, i) => ({ label: m, stroke: COLORS[i % COLORS.length], width: 2 }))],
      axes: [{}, { size: 60 }],
    }, data, box);
  } else {
    chart.plot.setData(data);
  }
  state.drawn += 1;
}

async function scrape() {
  let text;
  try {
    text = await (await fetch("/metrics", { cache: "no-store" })).text();
  } catch (error) {
    document.getElementById("status").textContent = "cannot reach /metrics: " + error;
    return;
  }
  const at = Date.now() / 1000;
  const now = parseMetrics(text);
  const dt = state.last ? at - state.lastAt : 0;
  state.times.push(at);
  for (const chart of state.charts) {
    const values = chart.fn(now, state.last, dt);
    for (const m in values) {
      if (!chart.series[m]) chart.series[m] = state.times.slice(0, -1).map(() => null);
    }
    for (const m in chart.series) chart.series[m].push(m in values ? values[m] : null);
  }
  if (state.times.length > KEEP_POINTS) {
    state.times.shift();
    for (const chart of state.charts) for (const m in chart.series) chart.series[m].shift();
  }
  state.last = now;
  state.lastAt = at;
  state.scrapes += 1;
  for (const chart of state.charts) draw(chart);
  document.getElementById("status").textContent =
    `${state.scrapes} scrapes of /metrics, every ${SCRAPE_MS / 1000} s; last at ${new Date().toLocaleTimeString()}`;
}

for (const chart of state.charts) {
  const div = document.createElement("div");
  div.className = "chart";
  div.innerHTML = `<h2></h2>`;
  div.querySelector("h2").textContent = chart.title;
  chart.box = div;
  document.getElementById("charts").appendChild(div);
}
scrape();
setInterval(scrape, SCRAPE_MS);
