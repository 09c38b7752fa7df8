// One sandbox: settings, custom-extension params, metrics over its life, the console log
// tail, and the lifecycle actions (each confirmed first).

import {h, fill, bytes, duration, since, facts} from './dom.js';
import {api, poll, say, confirmAction} from './app.js';
import {chart} from './plot.js';

/** Fields shown in the settings list, in order; any other field is listed after them. */
const KNOWN = ['sandboxID', 'state', 'templateID', 'alias', 'startedAt', 'endAt', 'cpuCount',
  'memoryMB', 'diskSizeMB', 'metadata', 'lifecycle', 'allowInternetAccess', 'hostInteractionIp',
  'networkNamespacePath', 'envdVersion', 'clientID'];
/** Never shown: credentials. */
const SECRET = ['envdAccessToken', 'trafficAccessToken'];
/** Metric sample fields that are no quantity to plot. */
const NOT_PLOTTED = ['timestamp', 'timestampUnix', 'cpuCount', 'memTotal', 'diskTotal'];
const MAX_SAMPLES = 5000;
/** Metric sample fields that count the sandbox's egress (bytes out, refused connections). */
const EGRESS = /^(egress|net|refused)/i;

export function mount(view, [id]) {
  const title = h('h1', {}, 'Sandbox ', h('span', {class: 'mono'}, id));
  const badge = h('span', {class: 'badge'});
  const actions = h('div', {class: 'actions', role: 'toolbar', 'aria-label': 'Actions'});
  const settings = h('section', {'aria-labelledby': 'settings-h'});
  const params = h('pre', {class: 'json', id: 'params'});
  const charts = h('div', {class: 'charts', id: 'charts'});
  const log = h('pre', {class: 'log', id: 'console-log', tabindex: '0', 'aria-label': 'Console log'});
  view.append(
    h('p', {}, h('a', {href: '#/sandboxes'}, '← Sandboxes')),
    h('div', {class: 'title'}, title, badge), actions,
    h('div', {class: 'columns'},
      h('div', {}, h('h2', {id: 'settings-h'}, 'Settings'), settings,
        h('h2', {}, 'Custom-extension params'), params),
      h('div', {}, h('h2', {}, 'Metrics'), charts)),
    h('h2', {}, 'Console log'), log);

  let detail = null;
  let gone = false;
  const samples = new Map();
  const refresh = async () => {
    if (gone) return;
    try {
      detail = (await api('GET', `/sandboxes/${id}`)).data;
    } catch (e) {
      if (e.status === 404) { gone = true; fill(settings, h('p', {class: 'error'}, 'This sandbox no longer exists.')); fill(actions); return; }
      throw e;
    }
    fill(badge, detail.state);
    badge.className = `badge ${detail.state}`;
    renderSettings(settings, detail);
    renderActions(actions, detail, id, refresh);
  };
  poll(refresh, 3000);
  poll(async () => {
    if (gone) return;
    fill(params, JSON.stringify((await api('GET', `/sandboxes/${id}/custom-extension-params`)).data, null, 2));
  }, 10000);
  poll(async () => {
    if (gone || !detail) return;
    const last = Math.max(0, ...samples.keys());
    const start = last ? last + 1 : Math.floor(Date.parse(detail.startedAt) / 1000);
    const end = Math.ceil(Date.now() / 1000);
    const r = await api('GET', `/sandboxes/${id}/metrics?start=${start}&end=${end}`);
    for (const m of r.data || []) {
      const t = m.timestampUnix || Math.floor(Date.parse(m.timestamp) / 1000);
      samples.set(t, m);
    }
    while (samples.size > MAX_SAMPLES) samples.delete(samples.keys().next().value);
    renderCharts(charts, [...samples.values()]);
  }, 3000);
  poll(async () => {
    if (gone) return;
    const text = (await api('GET', `/sandboxes/${id}/logs?lines=200`)).data;
    const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    if (log.textContent !== text) {
      fill(log, typeof text === 'string' ? text : JSON.stringify(text));
      if (atEnd) log.scrollTop = log.scrollHeight;
    }
  }, 5000);
}

function value(k, v) {
  if (k === 'metadata') {
    const e = Object.entries(v || {});
    return e.length ? h('ul', {class: 'chips'}, e.map(([a, b]) => h('li', {}, `${a}=${b}`))) : '—';
  }
  if (k === 'startedAt') return `${v} (${duration(since(v))} ago)`;
  if (k === 'endAt') return `${v} (in ${duration(-since(v))})`;
  if (k === 'memoryMB' || k === 'diskSizeMB') return `${v} MiB`;
  if (v !== null && typeof v === 'object') return h('code', {}, JSON.stringify(v));
  return String(v);
}

function renderSettings(el, d) {
  const keys = KNOWN.filter((k) => k in d).concat(Object.keys(d).filter((k) => !KNOWN.includes(k) && !SECRET.includes(k)));
  fill(el, facts(keys.map((k) => [k, value(k, d[k])])));
}

function renderActions(el, d, id, refresh) {
  const act = async (label, fn) => {
    try {
      el.setAttribute('aria-busy', 'true');
      for (const b of el.querySelectorAll('button')) b.disabled = true;
      await fn();
      say(`${label}: done`);
    } catch (e) {
      say(`${label} failed: ${e.message}`, true);
    } finally {
      el.removeAttribute('aria-busy');
      await refresh().catch(() => {});
    }
  };
  const running = d.state === 'running';
  const buttons = [];
  if (running) {
    buttons.push(h('a', {class: 'button', href: `#/sandboxes/${id}/terminal`}, 'Terminal'));
    buttons.push(h('button', {type: 'button', id: 'action-pause', onclick: async () => {
      if (await confirmAction(`Pause sandbox ${id}? Its memory is saved and it stops running.`, null, 'Pause')) {
        act('Pause', () => api('POST', `/sandboxes/${id}/pause`));
      }
    }}, 'Pause'));
    buttons.push(h('button', {type: 'button', id: 'action-snapshot', onclick: async () => {
      const name = h('input', {type: 'text', id: 'snapshot-name', pattern: '[A-Za-z0-9_-]{1,128}', 'aria-label': 'Snapshot name (optional)', placeholder: 'name (optional)'});
      if (await confirmAction(`Snapshot sandbox ${id}?`, h('label', {}, 'Name ', name), 'Snapshot')) {
        const body = name.value.trim() ? {name: name.value.trim()} : {};
        act('Snapshot', () => api('POST', `/sandboxes/${id}/snapshots`, body));
      }
    }}, 'Snapshot'));
    buttons.push(h('button', {type: 'button', id: 'action-timeout', onclick: async () => {
      const secs = h('input', {type: 'number', id: 'timeout-secs', min: '0', max: '31536000', value: '300', 'aria-label': 'Timeout in seconds'});
      if (await confirmAction(`Set the timeout of sandbox ${id} (seconds from now)?`, h('label', {}, 'Seconds ', secs), 'Set timeout')) {
        act('Set timeout', () => api('POST', `/sandboxes/${id}/timeout`, {timeout: Number(secs.value)}));
      }
    }}, 'Set timeout'));
  } else {
    buttons.push(h('button', {type: 'button', id: 'action-resume', onclick: async () => {
      if (await confirmAction(`Resume sandbox ${id} (timeout 300 s)?`, null, 'Resume')) {
        act('Resume', () => api('POST', `/sandboxes/${id}/connect`, {timeout: 300}));
      }
    }}, 'Resume'));
  }
  buttons.push(h('button', {type: 'button', id: 'action-delete', class: 'danger', onclick: async () => {
    if (await confirmAction(`Delete sandbox ${id}? This cannot be undone.`, null, 'Delete')) {
      act('Delete', async () => { await api('DELETE', `/sandboxes/${id}`); location.hash = '#/sandboxes'; });
    }
  }}, 'Delete'));
  if (el.hasAttribute('aria-busy')) return; // an action is running; its end refreshes
  // Keep the focused button across refreshes (keyboard users).
  const focused = document.activeElement && el.contains(document.activeElement) ? document.activeElement.id : null;
  const same = [...el.children].map((b) => b.id || b.textContent).join() === buttons.map((b) => b.id || b.textContent).join();
  if (same) {
    for (const b of el.querySelectorAll('button')) b.disabled = false;
    return;
  }
  fill(el, buttons);
  if (focused) document.getElementById(focused)?.focus();
}

function renderCharts(el, list) {
  list.sort((a, b) => (a.timestampUnix || 0) - (b.timestampUnix || 0));
  const t = (m) => m.timestampUnix || Math.floor(Date.parse(m.timestamp) / 1000);
  const series = (key, label, scale = 1) => ({label, points: list.filter((m) => typeof m[key] === 'number').map((m) => [t(m), m[key] * scale])});
  const out = [
    chart('CPU use (%)', [series('cpuUsedPct', 'CPU')], (v) => `${v.toFixed(0)}%`),
    chart('Memory', [series('memUsed', 'used'), series('memTotal', 'total'), series('memCache', 'cache')].filter((x) => x.points.length), bytes),
    chart('Disk', [series('diskUsed', 'used'), series('diskTotal', 'total')].filter((x) => x.points.length), bytes),
    ...egressCharts(list, series),
  ];
  // Any other numeric field (volumes, ...) gets a chart of its own.
  const known = ['cpuUsedPct', 'memUsed', 'memCache', 'diskUsed', ...NOT_PLOTTED];
  const extra = new Set(list.flatMap((m) => Object.keys(m).filter((k) => typeof m[k] === 'number' && !known.includes(k) && !EGRESS.test(k))));
  for (const k of extra) {
    const fmt = /bytes|Bytes|used|Used/.test(k) ? bytes : undefined;
    out.push(chart(k, [series(k, k)], fmt));
  }
  fill(el, out);
}

/** The sandbox's egress counters (bytes in one chart, counts in another), or a note when
 * the server reports none. */
function egressCharts(list, series) {
  const keys = [...new Set(list.flatMap((m) => Object.keys(m).filter((k) => typeof m[k] === 'number' && EGRESS.test(k))))];
  const sized = keys.filter((k) => /bytes/i.test(k));
  const counts = keys.filter((k) => !sized.includes(k));
  const figure = chart('Egress', sized.map((k) => series(k, k)), bytes);
  figure.id = 'egress-chart';
  if (!sized.length) fill(figure.querySelector('p.empty'), 'No egress byte counters: this server reports none per sandbox yet.');
  return counts.length ? [figure, chart('Egress connections', counts.map((k) => series(k, k)), (v) => v.toFixed(0))] : [figure];
}
