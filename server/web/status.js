// The status view: /metrics polled every second, the last minute kept, each figure drawn as a sparkline.

import { api, errorMessage } from "./api.js";

const POLL_MS = 1000;
const WINDOW_MS = 60_000;
const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 120; // the sparkline's own units; CSS sizes it
const HEIGHT = 32;
const M = "pagedserve:";

const gauge = (name, scale = 1) => (samples) => samples.map((s) => point(s.time, s.values.get(M + name) * scale));

// Per second, between consecutive samples; a counter that went back (a restart) leaves a gap.
const rate = (name) => (samples) =>
  pairs(samples, (a, b) => {
    const change = b.values.get(M + name) - a.values.get(M + name);
    return change >= 0 ? (change * 1000) / (b.time - a.time) : null;
  });

// Over the window up to each sample: prompts arrive now and then, so a per-interval ratio would be mostly gaps.
const windowRatio = (part, whole) => (samples) =>
  samples.map((b) => {
    const a = samples[0];
    const total = b.values.get(M + whole) - a.values.get(M + whole);
    return point(b.time, total > 0 ? (b.values.get(M + part) - a.values.get(M + part)) / total : null);
  });

const count = (value) => (value === null ? "–" : value.toFixed(0));
const percent = (value) => (value === null ? "–" : `${(value * 100).toFixed(1)} %`);
const perSecond = (value) => (value === null ? "–" : value.toFixed(1));

const CARDS = [
  { id: "running", label: "Running requests", series: gauge("num_requests_running"), format: count },
  { id: "waiting", label: "Waiting requests", series: gauge("num_requests_waiting"), format: count },
  { id: "kv-cache", label: "KV cache in use", series: gauge("kv_cache_usage_perc"), format: percent, max: 1 },
  {
    id: "prefix-hit-rate",
    label: "Prefix cache hit rate",
    series: windowRatio("prefix_cache_hits_total", "prefix_cache_queries_total"),
    format: percent,
    max: 1,
    note: (samples) => promptsNote(samples, "prefix_cache_queries_total"),
  },
  {
    id: "generation-rate",
    label: "Generated tokens/s",
    series: rate("generation_tokens_total"),
    format: perSecond,
    note: (samples) => `last minute: ${perSecond(windowRate(samples, "generation_tokens_total"))} /s`,
  },
  // Speculative decoding's cards show once the server has verified a proposal (speculation is on and used).
  {
    id: "spec-acceptance",
    label: "Proposed tokens accepted",
    series: windowRatio("spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total"),
    format: percent,
    max: 1,
    shown: speculating,
    note: (samples) => draftsNote(samples),
  },
  {
    id: "spec-accepted-per-draft",
    label: "Accepted tokens per draft",
    series: windowRatio("spec_decode_num_accepted_tokens_total", "spec_decode_num_drafts_total"),
    format: (value) => (value === null ? "–" : value.toFixed(2)),
    shown: speculating,
    note: () => "a draft: one sequence's proposals, verified in one step",
  },
];

function speculating(samples) {
  return samples.length > 0 && samples[samples.length - 1].values.get(M + "spec_decode_num_drafts_total") > 0;
}

function draftsNote(samples) {
  const drafts = "spec_decode_num_draft_tokens_total";
  const change = samples[samples.length - 1].values.get(M + drafts) - samples[0].values.get(M + drafts);
  return change > 0 ? `of ${change.toFixed(0)} proposed, last minute` : "none proposed in the last minute";
}

// Prometheus' text format: one `name{labels} value` per line; a name's values summed over its labels.
export function parseMetrics(text) {
  const values = new Map();
  for (const line of text.split("\n")) {
    const match = line.match(/^([a-zA-Z_:][\w:]*)(\{.*\})?\s+(\S+)/);
    if (!match) continue;
    const value = Number(match[3]);
    if (!Number.isNaN(value)) values.set(match[1], (values.get(match[1]) || 0) + value);
  }
  return values;
}

export class StatusView {
  constructor(container) {
    this.samples = [];
    this.polling = false;
    this.cards = CARDS.map((card) => ({ ...card, ...cardElements(container, card) }));
  }

  start() {
    this.poll();
    setInterval(() => this.poll(), POLL_MS);
  }

  async poll() {
    if (document.hidden || this.polling) return; // a slow answer must not pile up requests behind it
    this.polling = true;
    try {
      const response = await api("metrics");
      if (!response.ok) throw new Error(await errorMessage(response));
      this.add({ time: Date.now(), values: parseMetrics(await response.text()) });
      document.getElementById("status-error").textContent = "";
    } catch (error) {
      document.getElementById("status-error").textContent = `metrics unavailable: ${error.message}`;
    } finally {
      this.polling = false;
    }
  }

  add(sample) {
    this.samples.push(sample);
    while (this.samples[0].time < sample.time - WINDOW_MS) this.samples.shift();
    for (const card of this.cards) {
      card.figure.hidden = card.shown !== undefined && !card.shown(this.samples);
      const series = card.series(this.samples);
      const latest = series.length ? series[series.length - 1].value : null;
      card.output.textContent = card.format(latest);
      card.noteElement.textContent = card.note ? card.note(this.samples) : "";
      drawSparkline(card.path, series, card.max, sample.time);
    }
  }
}

function windowRate(samples, name) {
  if (samples.length < 2) return null;
  const [first, last] = [samples[0], samples[samples.length - 1]];
  const change = last.values.get(M + name) - first.values.get(M + name);
  return change >= 0 ? (change * 1000) / (last.time - first.time) : null;
}

function promptsNote(samples, queries) {
  const change = samples[samples.length - 1].values.get(M + queries) - samples[0].values.get(M + queries);
  return change > 0 ? `of ${change.toFixed(0)} prompt tokens, last minute` : "no prompts in the last minute";
}

function point(time, value) {
  return { time, value: Number.isFinite(value) ? value : null };
}

function pairs(samples, measure) {
  return samples.slice(1).map((b, i) => point(b.time, measure(samples[i], b)));
}

function cardElements(container, card) {
  const figure = document.createElement("figure");
  figure.className = "card";
  figure.id = `card-${card.id}`;
  const caption = document.createElement("figcaption");
  caption.textContent = card.label;
  const output = document.createElement("output");
  output.id = card.id;
  output.textContent = "–";
  const noteElement = document.createElement("small");
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("aria-hidden", "true");
  const path = document.createElementNS(SVG, "path");
  svg.append(path);
  figure.append(caption, output, noteElement, svg);
  container.append(figure);
  figure.hidden = card.shown !== undefined;
  return { figure, output, noteElement, path };
}

// The last minute, right-aligned on `now`; gaps where a value is missing.
function drawSparkline(path, series, fixedMax, now) {
  const known = series.filter((p) => p.value !== null);
  const max = fixedMax ?? (Math.max(...known.map((p) => p.value), 0) * 1.15 || 1);
  let d = "";
  let drawing = false;
  for (const { time, value } of series) {
    if (value === null) {
      drawing = false;
      continue;
    }
    const x = WIDTH - ((now - time) / WINDOW_MS) * WIDTH;
    const y = HEIGHT - 1 - (Math.min(value, max) / max) * (HEIGHT - 2);
    d += `${drawing ? "L" : "M"}${x.toFixed(2)},${y.toFixed(2)}`;
    drawing = true;
  }
  path.setAttribute("d", d);
}
