// What tests/console/console.cjs (Chromium, Playwright) and tests/console/firefox.cjs
// (Firefox, Puppeteer) share: the server's API, polling, and the one-JSON-line-per-step
// report that tests/e2e_console.rs reads. Env: AENV_URL, AENV_KEY.

const BASE = process.env.AENV_URL;
const KEY = process.env.AENV_KEY;
/** Sandbox metadata that must be shown as text, never become an element. */
const XSS = '<img src=x onerror=alert(1)>';

const report = (step, extra = {}) => console.log(JSON.stringify({step, ...extra}));
const fail = (why) => { throw new Error(why); };

async function api(method, p, body, headers = {}) {
  const init = {method, headers: {'X-API-Key': KEY, ...headers}};
  if (body !== undefined) {
    init.headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  const r = await fetch(BASE + p, init);
  const text = await r.text();
  let data = text;
  try { data = JSON.parse(text); } catch { /* text */ }
  return {status: r.status, data};
}

/** The processes envd runs in the sandbox (through the server's envd proxy). */
async function envdProcesses(id) {
  const r = await api('POST', '/process.Process/List', {}, {'E2b-Sandbox-Id': id});
  if (r.status !== 200) fail(`List: ${r.status} ${JSON.stringify(r.data)}`);
  return r.data.processes || [];
}

async function until(what, fn, ms = 60000, every = 250) {
  const end = Date.now() + ms;
  let last;
  while (Date.now() < end) {
    try { last = await fn(); if (last) return last; } catch (e) { last = e.message; }
    await new Promise((r) => setTimeout(r, every));
  }
  fail(`timed out waiting for ${what} (last: ${JSON.stringify(last)})`);
}

/** Runs main, printing a `failed` step and exiting non-zero on its first failure. */
function run(main) {
  main().catch((e) => {
    console.log(JSON.stringify({step: 'failed', error: e.message}));
    process.exit(1);
  });
}

module.exports = {BASE, KEY, XSS, report, fail, api, envdProcesses, until, run};
