// Templates: the list with build status, and one template's build (steps, live log).

import {h, fill, bytes, duration, since, facts} from './dom.js';
import {api, apiPaths, poll, say, confirmAction} from './app.js';

const PHASES = ['queued', 'pulling', 'unpacking', 'building_disk', 'booting', 'start_cmd', 'capturing', 'ready'];

export function mount(view, [id]) {
  if (id) detail(view, id);
  else list(view);
}

function name(t) {
  return (t.names && t.names[0]) || (t.aliases && t.aliases[0]) || t.templateID;
}

function list(view) {
  const tbody = h('tbody');
  view.append(h('h1', {}, 'Templates'),
    h('div', {class: 'scroll'}, h('table', {class: 'list', id: 'templates'},
      h('thead', {}, h('tr', {}, ['Name', 'Status', 'Phase', 'Image', 'CPU', 'Memory', 'Disk', 'Created', 'Sandboxes', ''].map((c) => h('th', {scope: 'col'}, c)))),
      tbody)));
  poll(async () => {
    const r = await api('GET', '/templates');
    const focused = document.activeElement && tbody.contains(document.activeElement) ? document.activeElement.id : null;
    fill(tbody, r.data.length ? r.data.map((t) => h('tr', {dataset: {id: t.templateID}},
      h('td', {}, h('a', {href: `#/templates/${encodeURIComponent(t.templateID)}`, id: `tpl-${t.templateID}`}, name(t))),
      h('td', {}, h('span', {class: `badge ${t.buildStatus}`}, t.buildStatus)),
      h('td', {}, (t.progress && t.progress.phase) || ''),
      h('td', {class: 'mono'}, t.image || ''),
      h('td', {}, String(t.cpuCount)),
      h('td', {}, `${t.memoryMB} MiB`),
      h('td', {}, `${t.diskSizeMB} MiB`),
      h('td', {}, `${duration(since(t.createdAt))} ago`),
      h('td', {}, String(t.spawnCount ?? 0)),
      h('td', {}, h('button', {type: 'button', class: 'danger small', id: `del-${t.templateID}`, 'aria-label': `Delete template ${name(t)}`, onclick: () => remove(t)}, 'Delete'))))
      : h('tr', {class: 'empty'}, h('td', {colspan: '10'}, 'No templates.')));
    if (focused) document.getElementById(focused)?.focus();
  }, 3000);
}

async function remove(t) {
  if (!(await confirmAction(`Delete template ${name(t)}? Sandboxes made from it keep running.`, null, 'Delete'))) return;
  try {
    await api('DELETE', `/templates/${encodeURIComponent(t.templateID)}`);
    say(`Template ${name(t)} deleted`);
    if (location.hash !== '#/templates') location.hash = '#/templates';
  } catch (e) {
    say(`Delete failed: ${e.message}`, true);
  }
}

function detail(view, id) {
  const title = h('h1', {}, 'Template');
  const info = h('div');
  const steps = h('ol', {class: 'steps', id: 'build-steps', 'aria-label': 'Build steps'});
  const log = h('pre', {class: 'log', id: 'build-log', tabindex: '0', 'aria-label': 'Build log', 'aria-live': 'polite'});
  const del = h('button', {type: 'button', class: 'danger'}, 'Delete');
  view.append(h('p', {}, h('a', {href: '#/templates'}, '← Templates')), title,
    h('div', {class: 'actions'}, del), info, h('h2', {}, 'Build steps'), steps, h('h2', {}, 'Build log'), log);
  let last = null;
  let logsOffset = 0;
  // The template builder's own logs (E2B's build status route), when this server has them.
  let buildLogs = null;
  const line = (text) => {
    log.appendChild(document.createTextNode(`${text}\n`));
    log.scrollTop = log.scrollHeight;
  };
  poll(async () => {
    const t = (await api('GET', `/templates/${encodeURIComponent(id)}`)).data;
    del.onclick = () => remove(t);
    fill(title, 'Template ', h('span', {class: 'mono'}, name(t)), ' ', h('span', {class: `badge ${t.buildStatus}`}, t.buildStatus));
    const p = t.progress || {};
    fill(info, facts([
      ['Template ID', t.templateID], ['Build ID', t.buildID || ''], ['Image', t.image || '—'],
      ['Start command', t.startCmd || '—'], ['Resources', `${t.cpuCount} vCPU, ${t.memoryMB} MiB, disk ${t.diskSizeMB} MiB`],
      ['Created', t.createdAt], ['Sandboxes made', String(t.spawnCount ?? 0)],
      ['Pulled', p.pullBytesTotal ? `${bytes(p.pullBytesDone)} of ${bytes(p.pullBytesTotal)}` : '—'],
      ...(t.reason ? [['Reason', h('span', {class: 'error'}, t.reason)]] : []),
    ]));
    renderSteps(steps, t);
    if (buildLogs === null) {
      buildLogs = (await apiPaths()).some((x) => /^\/templates\/\{[^}]+\}\/builds\/\{[^}]+\}\/status$/.test(x));
    }
    // Builds of E2B's template protocol have their own id and log; a POST /templates
    // build (buildID = templateID) reports its phases only.
    if (buildLogs && t.buildID && t.buildID !== t.templateID) {
      const r = await api('GET', `/templates/${encodeURIComponent(t.templateID)}/builds/${encodeURIComponent(t.buildID)}/status?logsOffset=${logsOffset}`);
      const entries = r.data.logEntries || (r.data.logs || []).map((m) => ({message: m}));
      for (const e of entries) line(e.timestamp ? `${e.timestamp} ${e.message}` : e.message);
      logsOffset += entries.length;
    }
    const now = `${p.phase || t.buildStatus}|${t.buildStatus}`;
    if (!(buildLogs && t.buildID && t.buildID !== t.templateID) && now !== last) {
      const pulled = p.pullBytesTotal ? ` (${bytes(p.pullBytesDone)} / ${bytes(p.pullBytesTotal)})` : '';
      line(`${new Date().toISOString()} ${t.buildStatus}: ${p.phase || ''}${pulled}${t.reason ? ` — ${t.reason}` : ''}`);
    }
    last = now;
  }, 1000);
}

function renderSteps(el, t) {
  if (Array.isArray(t.steps) && t.steps.length) {
    fill(el, t.steps.map((s) => h('li', {class: s.status || ''}, `${s.name || s.type || 'step'}${s.status ? ` — ${s.status}` : ''}`)));
    return;
  }
  const phase = (t.progress && t.progress.phase) || (t.buildStatus === 'ready' ? 'ready' : 'queued');
  const at = phase === 'failed' ? -1 : PHASES.indexOf(phase);
  fill(el, PHASES.map((p, i) => {
    const state = t.buildStatus === 'ready' || i < at ? 'done' : i === at ? 'current' : 'todo';
    return h('li', {class: state, 'aria-current': state === 'current' ? 'step' : null}, p.replace('_', ' '));
  }).concat(phase === 'failed' ? [h('li', {class: 'failed'}, 'failed')] : []));
}
