// The console's shell: login, the API client, the router and shared widgets.
// The API key lives in this tab's sessionStorage only and goes out as X-API-Key.

import {h, fill} from './dom.js';
import * as sandboxes from './sandboxes.js';
import * as sandbox from './sandbox.js';
import * as terminal from './terminal.js';
import * as templates from './templates.js';
import * as host from './host.js';

const KEY = 'agentenv.apiKey';

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY) || '';
}

/** One API call: parsed JSON (or text), or an ApiError with the server's message. */
export async function api(method, path, body) {
  const headers = {'X-API-Key': apiKey()};
  const init = {method, headers, cache: 'no-store'};
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  let r;
  try {
    r = await fetch(path, init);
  } catch (e) {
    throw new ApiError(0, `the server is unreachable (${e.message})`);
  }
  const text = await r.text();
  let data = text;
  if ((r.headers.get('Content-Type') || '').startsWith('application/json') && text) {
    try { data = JSON.parse(text); } catch { data = text; }
  }
  if (r.status === 401) {
    logout('The server refused the API key; log in again.');
    throw new ApiError(401, 'unauthorized');
  }
  if (!r.ok) {
    const message = (data && data.message) || text || r.statusText;
    throw new ApiError(r.status, message);
  }
  return {status: r.status, data, headers: r.headers};
}

let documented = null;
/** The API's paths (GET /openapi.json), to use routes only where this server has them. */
export async function apiPaths() {
  if (!documented) {
    documented = fetch('/openapi.json', {cache: 'no-store'}).then((r) => r.json())
      .then((doc) => Object.keys(doc.paths || {})).catch(() => []);
  }
  return documented;
}

/** Runs fn now and then every ms until the view changes; errors go to the status line. */
export function poll(fn, ms) {
  let stopped = false, timer = null;
  const run = async () => {
    if (stopped) return;
    if (!document.hidden) {
      try { await fn(); } catch (e) { if (!stopped && e.status !== 401) say(e.message, true); }
    }
    if (!stopped) timer = setTimeout(run, ms);
  };
  run();
  const stop = () => { stopped = true; clearTimeout(timer); };
  current.cleanups.push(stop);
  return stop;
}

/** Registers a cleanup for the current view. */
export function onLeave(fn) {
  current.cleanups.push(fn);
}

/** A short message in the status line (role=status). */
export function say(text, isError = false) {
  const el = document.getElementById('status');
  fill(el, text);
  el.classList.toggle('error', isError);
  el.hidden = !text;
  clearTimeout(say.timer);
  if (text) say.timer = setTimeout(() => { el.hidden = true; }, isError ? 8000 : 4000);
}

/** Asks before a destructive action; extra is an optional element (an input) in the dialog.
 * Resolves to true when confirmed. */
export function confirmAction(text, extra = null, okLabel = 'Confirm') {
  const dialog = document.getElementById('confirm');
  fill(document.getElementById('confirm-text'), text);
  fill(document.getElementById('confirm-extra'), extra);
  const ok = document.getElementById('confirm-ok');
  const cancel = document.getElementById('confirm-cancel');
  fill(ok, okLabel);
  return new Promise((resolve) => {
    const done = (value) => {
      ok.removeEventListener('click', yes);
      cancel.removeEventListener('click', no);
      dialog.removeEventListener('cancel', no);
      if (dialog.open) dialog.close();
      resolve(value);
    };
    const yes = () => done(true);
    const no = (e) => { if (e) e.preventDefault(); done(false); };
    ok.addEventListener('click', yes);
    cancel.addEventListener('click', no);
    dialog.addEventListener('cancel', no);
    dialog.showModal();
    const input = extra && (extra.matches('input') ? extra : extra.querySelector('input'));
    (input || cancel).focus();
  });
}

const routes = [
  [/^#\/sandboxes\/([0-9a-f-]+)\/terminal$/, terminal, 'sandboxes'],
  [/^#\/sandboxes\/([0-9a-f-]+)$/, sandbox, 'sandboxes'],
  [/^#\/sandboxes$/, sandboxes, 'sandboxes'],
  [/^#\/templates\/([^/]+)$/, templates, 'templates'],
  [/^#\/templates$/, templates, 'templates'],
  [/^#\/host$/, host, 'host'],
];

const current = {cleanups: []};

function leave() {
  for (const fn of current.cleanups.splice(0)) {
    try { fn(); } catch { /* a view's cleanup must not stop the next view */ }
  }
}

function route() {
  leave();
  const view = document.getElementById('view');
  if (!apiKey()) {
    showLogin();
    return;
  }
  document.getElementById('login').hidden = true;
  document.querySelector('header.top').hidden = false;
  const hash = location.hash || '#/sandboxes';
  for (const [re, mod, section] of routes) {
    const m = hash.match(re);
    if (m) {
      for (const a of document.querySelectorAll('nav a')) {
        if (a.dataset.section === section) a.setAttribute('aria-current', 'page');
        else a.removeAttribute('aria-current');
      }
      fill(view);
      mod.mount(view, m.slice(1).map(decodeURIComponent));
      return;
    }
  }
  location.hash = '#/sandboxes';
}

function showLogin(message = '') {
  fill(document.getElementById('view'));
  document.querySelector('header.top').hidden = true;
  document.getElementById('login').hidden = false;
  fill(document.getElementById('login-error'), message);
  document.getElementById('api-key').focus();
}

export function logout(message = '') {
  sessionStorage.removeItem(KEY);
  leave();
  showLogin(message);
}

async function login(event) {
  event.preventDefault();
  const input = document.getElementById('api-key');
  const key = input.value.trim();
  fill(document.getElementById('login-error'));
  // The key is checked with a cheap authenticated read before it is kept.
  const r = await fetch('/v2/sandboxes?limit=1', {headers: {'X-API-Key': key}, cache: 'no-store'})
    .catch((e) => ({ok: false, status: 0, statusText: e.message}));
  if (!r.ok) {
    const why = r.status === 401 ? 'This API key is not valid for this server.'
      : `The server answered ${r.status} ${r.statusText}.`;
    fill(document.getElementById('login-error'), why);
    input.select();
    return;
  }
  sessionStorage.setItem(KEY, key);
  input.value = '';
  route();
  document.getElementById('main').focus();
}

document.getElementById('login-form').addEventListener('submit', login);
document.getElementById('logout').addEventListener('click', () => logout());
window.addEventListener('hashchange', route);
route();
