"""The dashboard page: one self-contained HTML file whose script draws the figures as SVG.

The page carries the figures (``doctor.figures``) and a first payload in a JSON script
element; served, it then asks ``API_PATH?offset=...`` every ``poll_ms`` for what is new and
redraws; written to a file (``poll_ms`` 0), it is a snapshot that needs no server. No
library is loaded from anywhere: the page works offline and on a cluster's login node.
"""

from __future__ import annotations

import html
import json
from typing import Any

from meshyard.doctor.dashboard.run_source import Payload
from meshyard.doctor.figures import FIGURES, as_json

API_PATH = "api/records"  # relative: the page works behind a proxy that serves it under a prefix

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.2rem auto;max-width:1200px;
color:#1d2330;background:#fafbfc}h1{font-size:1.4rem;margin:.2rem 0}#status{color:#667;font-size:.9rem}
#status.error{color:#b91c1c}.tiles{display:flex;flex-wrap:wrap;gap:.6rem;margin:1rem 0}
.tile{background:#fff;border:1px solid #e3e6ec;border-radius:.5rem;padding:.5rem .8rem;min-width:7.5rem}
.tile b{display:block;font-size:1.25rem}.tile span{color:#667;font-size:.8rem}
.figures{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:.8rem}
figure{margin:0;background:#fff;border:1px solid #e3e6ec;border-radius:.5rem;padding:.5rem}
figcaption{font-weight:600;font-size:.95rem}.legend{font-size:.8rem;color:#445}
.legend i{display:inline-block;width:.8rem;height:.8rem;margin:0 .25rem 0 .7rem;vertical-align:-1px}
svg text{font-size:11px;fill:#667}.empty{fill:#99a;font-size:13px}#events li{margin:.15rem 0}
.restart{color:#b91c1c}.guard{color:#c2410c}
"""

_SCRIPT = r"""
const config = JSON.parse(document.getElementById('dashboard-config').textContent);
const COLORS = ['#2563eb', '#ea580c', '#16a34a', '#9333ea', '#0891b2', '#a16207', '#db2777'];
const W = 520, H = 210, L = 58, R = 10, T = 10, B = 24;
const records = new Map(), events = new Map();
let offset = 0, polls = 0, finished = false;

function esc(text) {
  return String(text).replace(/[&<>"]/g, c => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'})[c]);
}

function fmt(v) {
  if (v === undefined || v === null || Number.isNaN(v)) return '–';
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toPrecision(3) + 'G';
  if (a >= 1e6) return (v / 1e6).toPrecision(3) + 'M';
  if (a >= 1e4) return (v / 1e3).toPrecision(3) + 'k';
  return a >= 100 || a === 0 ? v.toFixed(a >= 100 ? 0 : 1) : v.toPrecision(3);
}

function take(p) {
  if (p.reset) records.clear();
  for (const r of p.records) records.set(r.step, r);
  for (const e of p.events) events.set(e.kind + ':' + e.step + ':' + e.text, e);
  offset = p.offset; finished = p.finished;
  render();
}

function seriesOf(fig, rows) {
  return fig.series.map((s, i) => ({label: s.label, color: COLORS[i % COLORS.length],
    points: rows.filter(r => typeof r[s.key] === 'number' && Number.isFinite(r[s.key]))
                .map(r => [r.step, r[s.key] * s.scale])})).filter(s => s.points.length);
}

function stack(series) {
  // Each series on top of the ones before it, step by step (the breakdown's parts add up);
  // the legend keeps each part's own last value.
  const below = new Map();
  return series.map(s => {
    const top = s.points.map(([x, y]) => [x, (below.get(x) || 0) + y]);
    const base = s.points.map(([x]) => [x, below.get(x) || 0]);
    top.forEach(([x, y]) => below.set(x, y));
    return {...s, points: top, base: base, last: s.points[s.points.length - 1][1]};
  });
}

function chart(fig, rows) {
  let series = seriesOf(fig, rows);
  if (!series.length) return `<svg viewBox="0 0 ${W} ${H}" width="100%"><text class="empty" x="${W / 2}" ` +
    `y="${H / 2}" text-anchor="middle">no ${fig.title.toLowerCase()} recorded yet</text></svg>`;
  if (fig.stacked) series = stack(series);
  const xs = series.flatMap(s => s.points.map(p => p[0])), ys = series.flatMap(s => s.points.map(p => p[1]));
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  let y0 = fig.stacked || fig.name !== 'loss' ? Math.min(0, ...ys) : Math.min(...ys), y1 = Math.max(...ys);
  if (y1 <= y0) y1 = y0 + (Math.abs(y0) || 1);
  const px = x => L + (x - x0) / (x1 - x0) * (W - L - R), py = y => T + (y1 - y) / (y1 - y0) * (H - T - B);
  const line = pts => pts.map(([x, y]) => px(x).toFixed(1) + ',' + py(y).toFixed(1)).join(' ');
  let out = `<svg viewBox="0 0 ${W} ${H}" width="100%" role="img" aria-label="${fig.title}">`;
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    out += `<line x1="${L}" x2="${W - R}" y1="${py(y)}" y2="${py(y)}" stroke="#eef"/>` +
           `<text x="${L - 4}" y="${py(y) + 4}" text-anchor="end">${fmt(y)}</text>`;
  }
  out += `<text x="${L}" y="${H - 6}">step ${x0}</text><text x="${W - R}" y="${H - 6}" text-anchor="end">${x1}</text>`;
  if (fig.name === 'loss') for (const e of events.values()) if (e.step >= x0 && e.step <= x1)
    out += `<line class="event ${e.kind}" x1="${px(e.step)}" x2="${px(e.step)}" y1="${T}" y2="${H - B}" ` +
           `stroke="${e.kind === 'restart' ? '#b91c1c' : '#c2410c'}" stroke-dasharray="3,3"><title>${esc(e.text)}</title></line>`;
  for (const s of series) {
    if (fig.stacked) out += `<polygon fill="${s.color}" fill-opacity="0.75" points="${line(s.points)} ` +
                            `${line([...s.base].reverse())}"/>`;
    else out += `<polyline fill="none" stroke="${s.color}" stroke-width="1.6" points="${line(s.points)}"/>`;
  }
  return out + '</svg><div class="legend">' +
    series.map(s => `<i style="background:${s.color}"></i>${esc(s.label)} ` +
                    fmt(s.last ?? s.points[s.points.length - 1][1])).join('') + ` <span>(${fig.unit})</span></div>`;
}

function tile(id, label, value) {
  document.getElementById('stat-' + id).innerHTML = `<b>${value}</b><span>${label}</span>`;
}

function render() {
  const rows = [...records.values()].sort((a, b) => a.step - b.step), last = rows[rows.length - 1] || {};
  const all = [...events.values()];
  tile('step', 'step', last.step ?? '–');
  tile('loss', 'loss', fmt(last.loss));
  tile('throughput', 'tokens/s', fmt(last.tokens_per_s));
  tile('mfu', 'MFU', last.mfu === undefined ? '–' : fmt(100 * last.mfu) + '%');
  tile('step-time', 'step time', last.step_time_s === undefined ? '–' : fmt(1000 * last.step_time_s) + ' ms');
  tile('cost', 'cost so far / projected', last.cost_so_far_usd === undefined ? '–' :
       '$' + fmt(last.cost_so_far_usd) + ' / $' + fmt(last.cost_projected_usd));
  tile('restarts', 'restarts', all.filter(e => e.kind === 'restart').length);
  tile('guard', 'guard events', all.filter(e => e.kind === 'guard').length);
  for (const fig of config.figures) document.querySelector(`figure[data-figure="${fig.name}"] .chart`).innerHTML =
    chart(fig, rows);
  document.getElementById('events').innerHTML = all.length ? all.sort((a, b) => a.step - b.step)
    .map(e => `<li class="${e.kind}">${e.kind}: ${esc(e.text)}</li>`).join('') : '<li>none</li>';
  document.body.dataset.lastStep = last.step ?? '';
}

function status(text, error) {
  const el = document.getElementById('status');
  el.textContent = text; el.className = error ? 'error' : '';
}

async function poll() {
  try {
    const answer = await fetch(config.api + '?offset=' + encodeURIComponent(offset));
    const body = await answer.json();
    if (!answer.ok) throw new Error(body.error || answer.statusText);
    take(body);
    status((finished ? 'finished' : 'live') + ', updated ' + new Date().toLocaleTimeString(), false);
  } catch (err) {
    status('cannot update: ' + err.message, true);
  }
  document.body.dataset.polls = ++polls;
  setTimeout(poll, config.poll_ms);
}

take(config.payload);
if (config.poll_ms > 0) { status('live, polling every ' + config.poll_ms + ' ms', false); setTimeout(poll, config.poll_ms); }
else status('snapshot taken ' + config.taken, false);
"""

_TILES = ("step", "loss", "throughput", "mfu", "step-time", "cost", "restarts", "guard")


def _json_for_script(value: Any) -> str:
    """JSON safe inside a <script> element: no '</' may close it early."""
    return json.dumps(value).replace("</", "<\\/")


def render_page(payload: Payload, poll_ms: int, taken: str = "") -> str:
    """The page with ``payload`` drawn at load; it polls every ``poll_ms`` (0: a snapshot taken at ``taken``)."""
    config = {"figures": as_json(), "poll_ms": poll_ms, "api": API_PATH, "payload": payload, "taken": taken}
    tiles = "".join(f'<div class="tile" id="stat-{name}"></div>' for name in _TILES)
    figures = "".join(f'<figure data-figure="{figure.name}"><figcaption>{html.escape(figure.title)}</figcaption>'
                      f'<div class="chart"></div></figure>' for figure in FIGURES)
    title = html.escape(payload["title"])
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>meshyard dashboard: {title}</title>"
            f"<style>{_STYLE}</style></head><body><h1>meshyard run {title}</h1><div id='status'></div>"
            f"<div class='tiles'>{tiles}</div><div class='figures'>{figures}</div>"
            f"<h2>Restarts and guard events</h2><ul id='events'></ul>"
            f"<script type='application/json' id='dashboard-config'>{_json_for_script(config)}</script>"
            f"<script>{_SCRIPT}</script></body></html>")
