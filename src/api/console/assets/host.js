// The host: capacity and use now, and over the last hour (GET /metrics/history, the
// numbers GET /metrics shows), with hook attempts and latency by hook and status.

import {h, fill, facts} from './dom.js';
import {api, poll} from './app.js';
import {chart} from './plot.js';

/** `name{a="b",c="d"}` → {name, labels}. */
export function parseSeries(key) {
  const m = key.match(/^([^{]+)(?:\{(.*)\})?$/);
  const labels = {};
  if (m && m[2]) {
    for (const [, k, v] of m[2].matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[k] = v.replace(/\\(.)/g, '$1');
  }
  return {name: m ? m[1] : key, labels};
}

export function mount(view) {
  const now = h('div', {id: 'host-now'});
  const hooks = h('div', {class: 'scroll'});
  const charts = h('div', {class: 'charts', id: 'host-charts'});
  view.append(h('h1', {}, 'Host'), now, h('h2', {}, 'Last hour'), charts, h('h2', {}, 'Hooks'), hooks);
  let samples = [];
  let lastT = 0;
  poll(async () => {
    const r = (await api('GET', `/metrics/history?since=${lastT}`)).data;
    for (const s of r.samples) samples.push({t: s.timestampUnix, v: s.values});
    if (samples.length) lastT = samples[samples.length - 1].t;
    const cutoff = lastT - 3600;
    samples = samples.filter((s) => s.t >= cutoff);
    render(now, charts, hooks, samples, r.node);
  }, 5000);
}

/** Per series key, its points. */
function byKey(samples, match) {
  const out = new Map();
  for (const s of samples) {
    for (const [k, v] of Object.entries(s.v)) {
      const p = parseSeries(k);
      if (!match(p)) continue;
      if (!out.has(k)) out.set(k, {p, points: []});
      out.get(k).points.push([s.t, v]);
    }
  }
  return out;
}

function gauge(samples, name, label) {
  return [...byKey(samples, (p) => p.name === name).values()].map(({p, points}) => ({label: p.labels[label] || p.name, points}));
}

/** Rate per minute of a counter between samples. */
function rate(points) {
  const out = [];
  for (let i = 1; i < points.length; i++) {
    const dt = points[i][0] - points[i - 1][0];
    if (dt > 0) out.push([points[i][0], Math.max(0, points[i][1] - points[i - 1][1]) * 60 / dt]);
  }
  return out;
}

function render(now, charts, hooks, samples, node) {
  const last = samples.length ? samples[samples.length - 1].v : {};
  const get = (k) => (k in last ? last[k] : null);
  const pair = (a, b, unit = '') => `${get(a) ?? '–'}${unit}, cap ${get(b) ?? 'none'}`;
  fill(now, facts([
    ['Node', node],
    ['Memory reserved', pair('agentenv_admission_memory_mb{state="reserved"}', 'agentenv_admission_memory_mb{state="limit"}', ' MiB')],
    ['vCPUs reserved', pair('agentenv_admission_vcpus{state="reserved"}', 'agentenv_admission_vcpus{state="limit"}')],
    ['Host memory', `${get('agentenv_host_memory_mb{state="available"}') ?? '–'} MiB available, ${get('agentenv_host_memory_mb{state="reserve"}') ?? '–'} MiB kept`],
    ['Network slots', `${get('agentenv_network_slots{state="in_use"}') ?? '–'} in use, ${get('agentenv_network_slots{state="pooled"}') ?? '–'} pooled`],
    ['Standby VMs', `${get('agentenv_standby_vms{state="ready"}') ?? '–'} ready`],
    ['Sandboxes', `${get('agentenv_sandboxes{state="running"}') ?? '–'} running, ${get('agentenv_sandboxes{state="paused"}') ?? '–'} paused`],
    ['Hook instances open', String(get('agentenv_hook_open_instances') ?? '–')],
  ]));
  const attempts = [...byKey(samples, (p) => p.name === 'agentenv_hook_requests_total').values()]
    .map(({p, points}) => ({label: `${p.labels.hook} ${p.labels.result}`, points: rate(points)}))
    .filter((x) => x.points.some((q) => q[1] > 0));
  const sums = byKey(samples, (p) => p.name === 'agentenv_hook_duration_seconds_sum');
  const counts = byKey(samples, (p) => p.name === 'agentenv_hook_duration_seconds_count');
  const latency = [];
  const table = [];
  for (const [k, {p, points}] of sums) {
    const c = counts.get(k.replace('_sum{', '_count{'));
    if (!c) continue;
    const pts = [];
    for (let i = 1; i < points.length && i < c.points.length; i++) {
      const dn = c.points[i][1] - c.points[i - 1][1];
      if (dn > 0) pts.push([points[i][0], ((points[i][1] - points[i - 1][1]) / dn) * 1000]);
    }
    latency.push({label: `${p.labels.hook} ${p.labels.status}`, points: pts});
    const n = c.points[c.points.length - 1][1];
    const sum = points[points.length - 1][1];
    table.push([p.labels.hook, p.labels.status, n, n ? (sum / n) * 1000 : 0]);
  }
  fill(charts,
    chart('Sandboxes', gauge(samples, 'agentenv_sandboxes', 'state'), (v) => v.toFixed(0)),
    chart('Memory reserved (MiB)', gauge(samples, 'agentenv_admission_memory_mb', 'state'), (v) => v.toFixed(0)),
    chart('vCPUs reserved', gauge(samples, 'agentenv_admission_vcpus', 'state'), (v) => v.toFixed(0)),
    chart('Network slots', gauge(samples, 'agentenv_network_slots', 'state'), (v) => v.toFixed(0)),
    chart('Standby VMs', gauge(samples, 'agentenv_standby_vms', 'state'), (v) => v.toFixed(0)),
    chart('Hook attempts per minute', attempts, (v) => v.toFixed(1)),
    chart('Hook latency (ms, mean per interval)', latency.filter((x) => x.points.length), (v) => v.toFixed(1)));
  table.sort((a, b) => (a[0] + a[1]).localeCompare(b[0] + b[1]));
  fill(hooks, table.length ? h('table', {class: 'list', id: 'hook-table'},
    h('thead', {}, h('tr', {}, ['Hook', 'Status', 'Attempts', 'Mean latency'].map((c) => h('th', {scope: 'col'}, c)))),
    h('tbody', {}, table.map(([hook, status, n, ms]) => h('tr', {}, h('td', {}, hook), h('td', {}, status), h('td', {}, String(n)), h('td', {}, `${ms.toFixed(1)} ms`)))))
    : h('p', {class: 'empty'}, 'No hook calls yet (or no custom extension configured).'));
}
