// Drives the web console in headless Chromium (Debian's /usr/bin/chromium, playwright-core
// from npm) against a real agentenv server; run by tests/e2e_console.rs.
// Env: AENV_URL, AENV_KEY, TEMPLATE_ID, SHOTS (screenshot dir), PLAYWRIGHT_CORE (module
// path), USER_DATA_DIR. Prints one JSON line per step; exits non-zero on the first failure.

const {chromium} = require(process.env.PLAYWRIGHT_CORE);
const fs = require('fs');
const path = require('path');
const {BASE, KEY, XSS, report, fail, api, envdProcesses, until, run} = require('./common.cjs');

const TEMPLATE = process.env.TEMPLATE_ID;
const SHOTS = process.env.SHOTS;

async function shot(page, name) {
  const file = path.join(SHOTS, `${name}.png`);
  await page.screenshot({path: file, fullPage: true});
  report('screenshot', {file});
}

/** No horizontal scrolling of the page itself (tables scroll in their own box). */
async function fitsWidth(page, name) {
  const [sw, w] = await page.evaluate(() => [document.documentElement.scrollWidth, window.innerWidth]);
  if (sw > w + 1) fail(`${name}: the page is ${sw}px wide in a ${w}px window`);
}

/** The focused element shows an outline (keyboard focus is visible). */
async function focusVisible(page, what) {
  const outline = await page.evaluate(() => {
    const s = getComputedStyle(document.activeElement);
    return [s.outlineStyle, parseFloat(s.outlineWidth)];
  });
  if (outline[0] === 'none' || !(outline[1] > 0)) fail(`no visible focus on ${what}: ${outline}`);
}

/** Logs a fresh tab in (sessionStorage is per tab), then opens hash. */
async function loginTab(page, hash) {
  await page.goto(`${BASE}/console/`);
  await page.waitForSelector('#login-form');
  await page.fill('#api-key', KEY);
  await page.keyboard.press('Enter');
  await page.waitForSelector('#sandboxes');
  await page.goto(`${BASE}/console/${hash}`);
}

async function main() {
  fs.mkdirSync(SHOTS, {recursive: true});
  const context = await chromium.launchPersistentContext(process.env.USER_DATA_DIR, {
    executablePath: '/usr/bin/chromium',
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
    viewport: {width: 1280, height: 800},
  });
  const errors = [];
  const dialogs = [];
  let allowLoginError = false;
  let allowGone = false;
  const watch = (page) => {
    page.on('console', (m) => {
      if (m.type() !== 'error') return;
      if (allowLoginError && /401/.test(m.text())) return;
      // Reads in flight when the page deleted the sandbox answer 404.
      if (allowGone && /Failed to load resource.*404/.test(m.text())) return;
      errors.push(m.text());
    });
    page.on('pageerror', (e) => errors.push(`pageerror: ${e.message}`));
    page.on('dialog', (d) => { dialogs.push(d.message()); d.dismiss(); });
  };
  const page = await context.newPage();
  watch(page);

  // Login: a wrong key is refused, the right one kept (in sessionStorage only).
  await page.goto(`${BASE}/console/`);
  await page.waitForSelector('#login-form');
  await shot(page, 'login-1280');
  allowLoginError = true;
  await page.fill('#api-key', 'x'.repeat(40));
  await page.click('#login-form button[type=submit]');
  await page.waitForFunction(() => document.getElementById('login-error').textContent.includes('not valid'));
  allowLoginError = false;
  await page.fill('#api-key', KEY);
  await page.keyboard.press('Enter');
  await page.waitForSelector('#sandboxes');
  const stored = await page.evaluate(() => [sessionStorage.length, localStorage.length, document.cookie]);
  if (stored[0] !== 1 || stored[1] !== 0 || stored[2] !== '') fail(`key storage: ${JSON.stringify(stored)}`);
  report('login');

  // A WebSocket without the key is refused (the browser sees it close without opening).
  const wsRefused = await page.evaluate((id) => new Promise((resolve) => {
    const ws = new WebSocket(`ws://${location.host}/console/terminal/${id}`);
    ws.onopen = () => resolve('opened');
    ws.onclose = () => resolve('refused');
  }), '01900000-0000-7000-8000-000000000000');
  if (wsRefused !== 'refused') fail(`WebSocket without key: ${wsRefused}`);
  errors.length = 0; // Chromium logs the refused handshake as an error
  report('websocket-without-key-refused');

  // A template build's log, live: the phases appear as they pass, then ready.
  await page.goto(`${BASE}/console/#/templates/${TEMPLATE}`);
  await page.waitForSelector('#build-log');
  const firstLines = await until('a first build log line', () => page.$eval('#build-log', (e) => e.textContent.trim()), 20000);
  await until('the build to be ready', () => page.$eval('#build-log', (e) => /ready/.test(e.textContent)), 240000, 500);
  const log = await page.$eval('#build-log', (e) => e.textContent.trim().split('\n'));
  if (log.length < 2) fail(`build log has ${log.length} lines: ${log}`);
  const steps = await page.$$eval('#build-steps li.done', (l) => l.length);
  if (steps < 2) fail(`${steps} build steps done`);
  report('template-build-log', {lines: log.length, first: firstLines.split('\n')[0], last: log[log.length - 1]});
  await shot(page, 'template-1280');
  await page.goto(`${BASE}/console/#/templates`);
  await page.waitForSelector(`#templates tr[data-id="${TEMPLATE}"]`);
  await shot(page, 'templates-1280');

  // A sandbox created through the API appears in the open list without a reload; its
  // metadata is shown as text.
  await page.goto(`${BASE}/console/#/sandboxes`);
  await page.waitForSelector('#sandboxes');
  await page.evaluate(() => { window.__sameDocument = true; });
  const created = await api('POST', '/sandboxes', {templateID: TEMPLATE, timeout: 900,
    metadata: {owner: XSS, suite: 'console'}});
  if (created.status !== 201) fail(`create: ${created.status} ${JSON.stringify(created.data)}`);
  const id = created.data.sandboxID;
  const row = `#sandboxes tr[data-id="${id}"]`;
  await page.waitForSelector(row, {timeout: 15000});
  if (!(await page.evaluate(() => window.__sameDocument))) fail('the list reloaded the page');
  const cellText = await page.$eval(row, (r) => r.textContent);
  if (!cellText.includes(`owner=${XSS}`)) fail(`metadata not shown as text: ${cellText}`);
  if (await page.$$eval('#sandboxes img', (l) => l.length)) fail('metadata became an element');
  report('sandbox-appears-live', {id});
  // Filters: by metadata and by state.
  await page.fill('#metadata-filter', 'suite=console');
  await page.waitForSelector(row);
  await page.fill('#metadata-filter', 'suite=other');
  await page.waitForSelector(row, {state: 'detached'});
  await page.fill('#metadata-filter', '');
  await page.selectOption('#state-filter', 'paused');
  await page.waitForSelector(row, {state: 'detached'});
  await page.selectOption('#state-filter', '');
  await page.waitForSelector(row);
  report('filters');
  await shot(page, 'sandboxes-1280');

  // Keyboard: Tab reaches the sandbox's link and Enter opens its page.
  await page.focus('#state-filter');
  let reached = false;
  for (let i = 0; i < 40 && !reached; i++) {
    await page.keyboard.press('Tab');
    reached = await page.evaluate((id) => document.activeElement && document.activeElement.textContent === id, id);
  }
  if (!reached) fail('Tab never reached the sandbox link');
  await focusVisible(page, 'the sandbox link');
  await page.keyboard.press('Enter');
  await page.waitForSelector('#charts');
  // On its page, Tab goes from the back link to the first action, with visible focus.
  await page.waitForSelector('#action-pause');
  await page.focus('a[href="#/sandboxes"]:not(nav a)');
  await page.keyboard.press('Tab');
  const first = await page.evaluate(() => document.activeElement.textContent);
  if (first !== 'Terminal') fail(`Tab after the back link reached ${JSON.stringify(first)}`);
  await page.keyboard.press('Tab');
  if ((await page.evaluate(() => document.activeElement.id)) !== 'action-pause') fail('Tab did not reach Pause');
  await focusVisible(page, 'the Pause button');
  report('keyboard-navigation');

  // The detail page plots metrics samples as they come.
  const points = await until('a CPU plot with 2 points', async () => {
    const n = await page.$eval('#charts figure', (f) => Number(f.dataset.points || 0));
    return n >= 2 && n;
  }, 40000, 500);
  const mark = await api('POST', `/sandboxes/${id}/commands`, {cmd: 'sh', args: ['-c', 'echo console-tail-$((6*7)) > /dev/console']});
  if (mark.status !== 200 || mark.data.exitCode !== 0) fail(`console line: ${mark.status} ${JSON.stringify(mark.data)}`);
  await until('the guest\'s console line in the log tail', () => page.$eval('#console-log', (e) => e.textContent.includes('console-tail-42')), 20000);
  const settings = await page.$eval('dl.facts', (e) => e.textContent);
  if (!settings.includes(XSS) || settings.includes('envdAccessToken')) fail(`settings: ${settings}`);
  const egress = await page.$eval('#egress-chart', (f) => [Number(f.dataset.points || 0), f.textContent]);
  report('detail-plot', {points, egressPoints: egress[0], egress: egress[1]});
  await shot(page, 'sandbox-1280');

  // Delete asks first; Escape cancels and nothing happens.
  await page.focus('#action-delete');
  await page.keyboard.press('Enter');
  await page.waitForSelector('#confirm[open]');
  await page.keyboard.press('Escape');
  await page.waitForSelector('#confirm', {state: 'hidden'});
  if ((await api('GET', `/sandboxes/${id}`)).status !== 200) fail('cancelled delete deleted');
  report('confirm-cancel');

  // The terminal: echo hi, resize, a flood that leaves the API answering, then closing the
  // tab kills the PTY.
  const term = await context.newPage();
  watch(term);
  await loginTab(term, `#/sandboxes/${id}/terminal`);
  await term.waitForFunction(() => document.querySelector('.term-status').textContent.startsWith('Connected'), null, {timeout: 20000});
  const screenText = () => term.$eval('#terminal', (e) => e.textContent);
  const lines = async () => (await term.$$eval('#terminal .line', (l) => l.map((x) => x.textContent.trimEnd())));
  await term.focus('#terminal-input');
  await term.keyboard.type('echo hi');
  await term.keyboard.press('Enter');
  await until('hi in the terminal', async () => (await lines()).includes('hi'), 20000);
  await term.keyboard.type('whoami');
  await term.keyboard.press('Enter');
  await until('the default user in the terminal', async () => (await lines()).includes('user'), 20000);
  report('terminal-echo-hi');
  await shot(term, 'terminal-1280');
  const pty = (await envdProcesses(id)).filter((p) => p.config && p.config.cmd === '/bin/bash');
  if (pty.length !== 1) fail(`PTY processes: ${JSON.stringify(pty)}`);
  await term.setViewportSize({width: 900, height: 640});
  const size = await until('the screen to follow the window', async () => {
    const s = await term.evaluate(() => document.querySelector('.term-status').textContent);
    return s;
  }, 5000);
  await new Promise((r) => setTimeout(r, 800));
  await term.keyboard.type('stty size');
  await term.keyboard.press('Enter');
  const dims = await until('stty size', async () => (await lines()).find((l) => /^\d+ \d+$/.test(l)), 20000);
  const [rows, cols] = dims.split(' ').map(Number);
  if (cols >= 120 || cols < 20 || rows < 5) fail(`after the resize stty says ${dims} (${size})`);
  report('terminal-resize', {stty: dims});
  await term.keyboard.type('yes | head -c 400000; echo flood-$((6*7))');
  await term.keyboard.press('Enter');
  const health = [];
  const started = Date.now();
  while (!(await lines()).includes('flood-42')) {
    const t0 = Date.now();
    const r = await fetch(`${BASE}/health`);
    health.push(Date.now() - t0);
    if (r.status !== 204) fail(`health during flood: ${r.status}`);
    if (Date.now() - started > 150000) fail('the flood never ended');
    await new Promise((r2) => setTimeout(r2, 200));
  }
  health.sort((a, b) => a - b);
  const worst = health[health.length - 1];
  if (worst > 5000) fail(`/health took ${worst} ms during the flood`);
  report('terminal-flood', {seconds: (Date.now() - started) / 1000, healthChecks: health.length, healthMedianMs: health[health.length >> 1], healthMaxMs: worst});
  await term.close();
  await until('the PTY to be killed', async () => (await envdProcesses(id)).every((p) => !(p.config && p.config.cmd === '/bin/bash')), 20000, 500);
  report('terminal-closed-kills-pty');

  // Pause and resume from the page, each confirmed.
  await page.bringToFront();
  await page.click('#action-pause');
  await page.click('#confirm-ok');
  await page.waitForSelector('.title .badge.paused', {timeout: 90000});
  if ((await api('GET', `/sandboxes/${id}`)).data.state !== 'paused') fail('not paused');
  report('paused-from-page');
  await shot(page, 'sandbox-paused-1280');
  await page.click('#action-resume');
  await page.click('#confirm-ok');
  await page.waitForSelector('.title .badge.running', {timeout: 90000});
  if ((await api('GET', `/sandboxes/${id}`)).data.state !== 'running') fail('not running');
  report('resumed-from-page');

  // Set timeout and snapshot from the page, each confirmed.
  await page.click('#action-timeout');
  await page.fill('#timeout-secs', '600');
  await page.click('#confirm-ok');
  const endAt = await until('the new timeout', async () => {
    const left = (Date.parse((await api('GET', `/sandboxes/${id}`)).data.endAt) - Date.now()) / 1000;
    return left > 500 && left <= 600 && left;
  }, 20000);
  report('timeout-from-page', {secondsLeft: Math.round(endAt)});
  await page.waitForSelector('#action-snapshot:not([disabled])');
  await page.click('#action-snapshot');
  await page.fill('#snapshot-name', 'console-snapshot');
  await page.click('#confirm-ok');
  const snap = await until('the snapshot', async () => {
    const r = await api('GET', '/snapshots/console-snapshot');
    return r.status === 200 && r.data;
  }, 120000, 500);
  await page.waitForSelector('.title .badge.running');
  report('snapshot-from-page', {snapshot: snap.snapshotID || snap.templateID || snap.name});

  // The host page plots the /metrics history, hooks by hook and status.
  await page.goto(`${BASE}/console/#/host`);
  await until('host charts with points', () => page.$eval('#host-charts figure', (f) => Number(f.dataset.points || 0) > 1), 30000, 500);
  await page.waitForSelector('#hook-table tbody tr', {timeout: 30000});
  const hooks = await page.$$eval('#hook-table tbody tr', (l) => l.map((r) => r.textContent));
  report('host', {hooks});
  await shot(page, 'host-1280');

  // Phone width: every page fits, screenshots.
  await page.setViewportSize({width: 390, height: 844});
  for (const [name, hash, sel] of [['sandboxes', '#/sandboxes', `#sandboxes tr[data-id="${id}"]`],
    ['sandbox', `#/sandboxes/${id}`, '#charts figure'], ['templates', '#/templates', '#templates tbody tr'],
    ['host', '#/host', '#host-charts figure']]) {
    await page.goto(`${BASE}/console/${hash}`);
    await page.waitForSelector(sel);
    await new Promise((r) => setTimeout(r, 300));
    await fitsWidth(page, name);
    await shot(page, `${name}-390`);
  }
  const phoneTerm = await context.newPage();
  watch(phoneTerm);
  await phoneTerm.setViewportSize({width: 390, height: 844});
  await loginTab(phoneTerm, `#/sandboxes/${id}/terminal`);
  await phoneTerm.waitForFunction(() => document.querySelector('.term-status').textContent.startsWith('Connected'), null, {timeout: 20000});
  await fitsWidth(phoneTerm, 'terminal');
  await shot(phoneTerm, 'terminal-390');
  await phoneTerm.close();
  await page.setViewportSize({width: 1280, height: 800});

  // Delete from the page.
  await page.goto(`${BASE}/console/#/sandboxes/${id}`);
  await page.click('#action-delete');
  allowGone = true;
  await page.click('#confirm-ok');
  await page.waitForFunction(() => location.hash === '#/sandboxes');
  await until('the sandbox to be gone', async () => (await api('GET', `/sandboxes/${id}`)).status === 404, 30000);
  report('deleted-from-page');

  if (dialogs.length) fail(`dialogs opened: ${dialogs}`);
  if (errors.length) fail(`console errors: ${errors.join(' | ')}`);
  report('done', {sandbox: id});
  await context.close();
}

run(main);
