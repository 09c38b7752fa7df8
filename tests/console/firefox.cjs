// Drives the web console in headless Firefox (Debian's /usr/bin/firefox-esr over WebDriver
// BiDi, puppeteer-core from npm) against a real agentenv server; run by tests/e2e_console.rs
// after the Chromium part, on the same server and template. The essential checks: login (a
// wrong key refused), a sandbox made through the API appearing live with its metadata as
// text, the detail page's plot points, the terminal (`echo hi`), no console errors or
// dialogs, screenshots.
// Env: AENV_URL, AENV_KEY, TEMPLATE_ID, SHOTS, PUPPETEER_CORE (module path), USER_DATA_DIR.

const puppeteer = require(process.env.PUPPETEER_CORE);
const fs = require('fs');
const path = require('path');
const {BASE, KEY, XSS, report, fail, api, until, run} = require('./common.cjs');

const TEMPLATE = process.env.TEMPLATE_ID;
const SHOTS = process.env.SHOTS;

// The host has no route out: nothing may try to phone home (updates, telemetry, captive
// portal and connectivity checks, remote settings, experiments), which would only log
// errors and slow the start. puppeteer's own defaults already cover most of the rest.
const PREFS = {
  'app.normandy.enabled': false,
  'app.update.auto': false,
  'browser.discovery.enabled': false,
  'browser.ping-centre.telemetry': false,
  'datareporting.usage.uploadEnabled': false,
  'messaging-system.rsexperimentloader.enabled': false,
  'network.captive-portal-service.enabled': false,
  'network.connectivity-service.enabled': false,
  'network.dns.disablePrefetch': true,
  'network.prefetch-next': false,
  'toolkit.telemetry.enabled': false,
  'toolkit.telemetry.server': '',
  'toolkit.telemetry.unified': false,
};

async function shot(page, name) {
  const file = path.join(SHOTS, `firefox-${name}.png`);
  await page.screenshot({path: file, fullPage: true});
  report('screenshot', {file});
}

/** Logs a fresh tab in (sessionStorage is per tab), then opens hash. */
async function loginTab(page, hash) {
  await page.goto(`${BASE}/console/`);
  await page.waitForSelector('#login-form');
  await page.locator('#api-key').fill(KEY);
  await page.keyboard.press('Enter');
  await page.waitForSelector('#sandboxes');
  await page.goto(`${BASE}/console/${hash}`);
}

/** Console errors, uncaught exceptions and dialogs of every watched tab. */
function watcher() {
  const seen = {errors: [], dialogs: [], allowLoginError: false};
  seen.watch = (page) => {
    page.on('console', (m) => {
      if (m.type() !== 'error') return;
      if (seen.allowLoginError && /401/.test(m.text())) return;
      seen.errors.push(m.text());
    });
    page.on('pageerror', (e) => seen.errors.push(`pageerror: ${e.message}`));
    page.on('dialog', (d) => { seen.dialogs.push(d.message()); d.dismiss(); });
  };
  return seen;
}

async function login(page, seen) {
  await page.goto(`${BASE}/console/`);
  await page.waitForSelector('#login-form');
  await shot(page, 'login-1280');
  seen.allowLoginError = true;
  await page.locator('#api-key').fill('x'.repeat(40));
  await page.click('#login-form button[type=submit]');
  await page.waitForFunction(() => document.getElementById('login-error').textContent.includes('not valid'));
  seen.allowLoginError = false;
  await page.locator('#api-key').fill(KEY);
  await page.keyboard.press('Enter');
  await page.waitForSelector('#sandboxes');
  const stored = await page.evaluate(() => [sessionStorage.length, localStorage.length, document.cookie]);
  if (stored[0] !== 1 || stored[1] !== 0 || stored[2] !== '') fail(`key storage: ${JSON.stringify(stored)}`);
  report('login');
}

/** A sandbox created through the API appears in the open list, its metadata as text. */
async function appearsLive(page) {
  await page.goto(`${BASE}/console/#/sandboxes`);
  await page.waitForSelector('#sandboxes');
  await page.evaluate(() => { window.__sameDocument = true; });
  const created = await api('POST', '/sandboxes', {templateID: TEMPLATE, timeout: 600,
    metadata: {owner: XSS, suite: 'console-firefox'}});
  if (created.status !== 201) fail(`create: ${created.status} ${JSON.stringify(created.data)}`);
  const id = created.data.sandboxID;
  const row = `#sandboxes tr[data-id="${id}"]`;
  await page.waitForSelector(row, {timeout: 15000});
  if (!(await page.evaluate(() => window.__sameDocument))) fail('the list reloaded the page');
  const cellText = await page.$eval(row, (r) => r.textContent);
  if (!cellText.includes(`owner=${XSS}`)) fail(`metadata not shown as text: ${cellText}`);
  if (await page.$$eval('#sandboxes img', (l) => l.length)) fail('metadata became an element');
  report('sandbox-appears-live', {id});
  await shot(page, 'sandboxes-1280');
  return id;
}

/** The detail page plots metrics samples as they come and shows the metadata as text. */
async function detail(page, id) {
  await page.goto(`${BASE}/console/#/sandboxes/${id}`);
  await page.waitForSelector('#charts');
  const points = await until('a CPU plot with 2 points', async () => {
    const n = await page.$eval('#charts figure', (f) => Number(f.dataset.points || 0));
    return n >= 2 && n;
  }, 40000, 500);
  const settings = await page.$eval('dl.facts', (e) => e.textContent);
  if (!settings.includes(XSS) || settings.includes('envdAccessToken')) fail(`settings: ${settings}`);
  if (await page.$$eval('dl.facts img', (l) => l.length)) fail('metadata became an element');
  report('detail-plot', {points});
  await shot(page, 'sandbox-1280');
}

/** The terminal in its own tab: `echo hi` answers `hi`. */
async function terminal(browser, seen, id) {
  const term = await browser.newPage();
  seen.watch(term);
  await term.setViewport({width: 1280, height: 800});
  await loginTab(term, `#/sandboxes/${id}/terminal`);
  await term.waitForFunction(() => document.querySelector('.term-status').textContent.startsWith('Connected'), {timeout: 20000});
  const lines = () => term.$$eval('#terminal .line', (l) => l.map((x) => x.textContent.trimEnd()));
  await term.focus('#terminal-input');
  await term.keyboard.type('echo hi');
  await term.keyboard.press('Enter');
  await until('hi in the terminal', async () => (await lines()).includes('hi'), 20000);
  report('terminal-echo-hi');
  await shot(term, 'terminal-1280');
  await term.close();
}

async function main() {
  fs.mkdirSync(SHOTS, {recursive: true});
  const browser = await puppeteer.launch({
    browser: 'firefox',
    protocol: 'webDriverBiDi',
    executablePath: '/usr/bin/firefox-esr',
    headless: true,
    userDataDir: process.env.USER_DATA_DIR,
    extraPrefsFirefox: PREFS,
    defaultViewport: {width: 1280, height: 800},
  });
  report('launched', {version: await browser.version()});
  const seen = watcher();
  const page = await browser.newPage();
  seen.watch(page);
  await login(page, seen);
  const id = await appearsLive(page);
  await detail(page, id);
  await terminal(browser, seen, id);
  if (seen.dialogs.length) fail(`dialogs opened: ${seen.dialogs}`);
  if (seen.errors.length) fail(`console errors: ${seen.errors.join(' | ')}`);
  await browser.close();
  const gone = await api('DELETE', `/sandboxes/${id}`);
  if (gone.status !== 204) fail(`delete: ${gone.status} ${JSON.stringify(gone.data)}`);
  report('done', {sandbox: id});
}

run(main);
