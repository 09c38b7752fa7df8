// The sandboxes list: state, template, node, age, time left, CPU and memory, filtered by
// state and metadata, refreshed every 2 s.

import {h, fill, duration, since} from './dom.js';
import {api, poll} from './app.js';

const COLUMNS = ['Sandbox', 'State', 'Template', 'Node', 'Age', 'Time left', 'CPU', 'Memory', 'Metadata'];

/** The server's name (one node serves every sandbox it lists). */
let nodeName = null;
async function node() {
  if (nodeName === null) {
    const r = await api('GET', '/metrics/history?since=99999999999');
    nodeName = r.data.node || '';
  }
  return nodeName;
}

/** `k=v, k2=v2` from the filter box as the API's metadata query (api.md §4.4). */
export function metadataQuery(text) {
  const pairs = text.split(/[,&]/).map((p) => p.trim()).filter(Boolean).map((p) => {
    const i = p.indexOf('=');
    return i < 0 ? [p, ''] : [p.slice(0, i).trim(), p.slice(i + 1).trim()];
  });
  return new URLSearchParams(pairs).toString();
}

export function mount(view) {
  const state = h('select', {id: 'state-filter'},
    h('option', {value: ''}, 'All states'),
    h('option', {value: 'running'}, 'Running'),
    h('option', {value: 'paused'}, 'Paused'));
  const meta = h('input', {id: 'metadata-filter', type: 'search', placeholder: 'key=value, key2=value2', autocomplete: 'off'});
  const count = h('p', {class: 'count', 'aria-live': 'polite'});
  const tbody = h('tbody');
  view.appendChild(h('h1', {}, 'Sandboxes'));
  view.appendChild(h('form', {class: 'filters', role: 'search', onsubmit: (e) => { e.preventDefault(); refresh(); }},
    h('label', {for: 'state-filter'}, 'State'), state,
    h('label', {for: 'metadata-filter'}, 'Metadata'), meta,
    h('button', {type: 'submit'}, 'Filter')));
  view.appendChild(count);
  view.appendChild(h('div', {class: 'scroll'}, h('table', {id: 'sandboxes', class: 'list'},
    h('thead', {}, h('tr', {}, COLUMNS.map((c) => h('th', {scope: 'col'}, c)))), tbody)));
  const rows = new Map();
  let latest = 0;
  const refresh = async () => {
    const ask = ++latest;
    const q = new URLSearchParams();
    if (state.value) q.set('state', state.value);
    const m = metadataQuery(meta.value);
    if (m) q.set('metadata', m);
    const [list, name] = await Promise.all([api('GET', `/v2/sandboxes?${q}`), node()]);
    if (ask !== latest) return; // a newer filter answered first
    render(tbody, rows, list.data, name);
    fill(count, `${list.data.length} sandbox${list.data.length === 1 ? '' : 'es'}`);
  };
  state.addEventListener('change', refresh);
  meta.addEventListener('input', () => { clearTimeout(meta.timer); meta.timer = setTimeout(refresh, 300); });
  poll(refresh, 2000);
}

function cells(sb, name) {
  const left = sb.state === 'running' ? duration((Date.parse(sb.endAt) - Date.now()) / 1000) : 'paused';
  const meta = Object.entries(sb.metadata || {});
  return [
    h('a', {href: `#/sandboxes/${sb.sandboxID}`, class: 'mono'}, sb.sandboxID),
    h('span', {class: `badge ${sb.state}`}, sb.state),
    sb.alias || sb.templateID || '',
    name,
    duration(since(sb.startedAt)),
    left,
    String(sb.cpuCount),
    `${sb.memoryMB} MiB`,
    meta.length ? h('ul', {class: 'chips'}, meta.map(([k, v]) => h('li', {}, `${k}=${v}`))) : '',
  ];
}

/** Updates rows in place (keyed by id) so focus and selection survive a refresh. */
function render(tbody, rows, list, name) {
  const seen = new Set();
  let changedOrder = false;
  list.forEach((sb, i) => {
    seen.add(sb.sandboxID);
    const fresh = cells(sb, name);
    let row = rows.get(sb.sandboxID);
    if (!row) {
      row = h('tr', {dataset: {id: sb.sandboxID}}, fresh.map((c) => h('td', {}, c)));
      rows.set(sb.sandboxID, row);
      changedOrder = true;
    } else {
      fresh.forEach((c, j) => {
        const td = row.children[j];
        const text = c instanceof Node ? c.textContent : String(c);
        if (td.textContent !== text) fill(td, c);
      });
    }
    if (tbody.children[i] !== row) changedOrder = true;
  });
  for (const [id, row] of rows) {
    if (!seen.has(id)) { row.remove(); rows.delete(id); }
  }
  if (changedOrder) list.forEach((sb) => tbody.appendChild(rows.get(sb.sandboxID)));
  const empty = tbody.querySelector('tr.empty');
  if (list.length === 0 && !empty) {
    tbody.appendChild(h('tr', {class: 'empty'}, h('td', {colspan: COLUMNS.length}, 'No sandboxes match.')));
  } else if (list.length && empty) {
    empty.remove();
  }
}
