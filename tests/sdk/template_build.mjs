// The JS SDK's Template builder on the Debian 12 image (AENV_TEST_IMAGE): the template of
// template_build.py (ENV, RUN, USER, WORKDIR, COPY of a directory and a file with owner
// and mode, a python3 HTTP server behind waitForPort) with its own last step, built after
// the python one so the steps both SDKs send alike come from the step cache; a sandbox
// from it checked (user, files, python3 -c, sudo -n true, the start command's port
// through the API port's routing, or in domain mode at getHost(8080)). The SDK module
// comes from AENV_E2B_JS.
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

const { Sandbox, Template, waitForPort } = await import(process.env.AENV_E2B_JS);
const image = process.env.AENV_TEST_IMAGE;
const alias = 'debian-js';
const started = Date.now();

function ok(call, condition = true, seen = undefined) {
  if (!condition) throw new Error(`${call}: unexpected ${JSON.stringify(seen)}`);
  console.log(`ok ${call}`);
}

// The same files as template_build.py's context (paths, content, modes).
const ctx = fs.mkdtempSync(path.join(os.tmpdir(), 'aenv-js-ctx-'));
fs.mkdirSync(path.join(ctx, 'app', 'sub'), { recursive: true });
fs.writeFileSync(path.join(ctx, 'app', 'hello.txt'), 'hello from the context\n');
fs.writeFileSync(path.join(ctx, 'app', 'sub', 'deep.txt'), 'deep\n');
fs.writeFileSync(path.join(ctx, 'tool.sh'), '#!/bin/sh\necho tool-ran\n');

const template = Template({ fileContextPath: ctx })
  .fromImage(image)
  .setEnvs({ GREETING: 'hi', BUILD_SECRET: 's3cret' })
  .runCmd('id -un > /tmp/step-user && echo step-output-line')
  .setUser('root')
  .setWorkdir('/srv/app')
  .copy('app', '/srv/app/', { user: 'user', mode: 0o750 })
  .copy('tool.sh', '/usr/local/bin/tool.sh', { mode: 0o755 })
  .runCmd('echo "$GREETING $BUILD_SECRET" > stamp && cat /proc/sys/kernel/random/uuid > stamp-early && pwd > wd')
  .setUser('user')
  .runCmd('echo js > /srv/app/last')
  .setStartCmd(
    'mkdir -p /tmp/www && echo served > /tmp/www/index.html && cd /tmp/www && exec python3 -m http.server 8080',
    waitForPort(8080),
  );

const logs = [];
const info = await Template.build(template, alias, { onBuildLogs: (e) => logs.push(e.message) });
const text = logs.join('\n');
ok('Template.build returns ids', Boolean(info.templateId && info.buildId), info);
// ENV, RUN, USER and WORKDIR are sent as the python SDK sends them: cached. The JS SDK
// hashes a directory's size into the COPY's filesHash (python does not), so the
// directory COPY and what follows run again.
const cached = logs.filter((l) => l.startsWith('CACHED ['));
// AENV_TEST_FRESH=1: no python build ran before (the domain-mode run), nothing cached.
if (process.env.AENV_TEST_FRESH !== '1') {
  ok(`the steps both SDKs send alike come from the cache (${cached.length} of 9 cached)`, ['1', '2', '3', '4'].every((i) => cached.some((l) => l.startsWith(`CACHED [${i}/9]`))), text.slice(-3000));
}
ok('the last step ran', logs.some((l) => l.startsWith('[9/9] RUN echo js')), text.slice(-3000));
ok('the build waited with waitForPort', text.includes('waiting for the ready command: [ -n "$(ss -Htuln sport = :8080)" ]'), text.slice(-3000));

const sbx = await Sandbox.create(alias, { timeoutMs: 300_000 });
try {
  const { name } = await sbx.getInfo();
  ok("getInfo().name is the template's alias", name === alias, name);
  const run = async (cmd, opts) => (await sbx.commands.run(cmd, opts)).stdout.trim();
  ok('sandbox runs as user by default', (await run('id -un')) === 'user');
  ok('COPY dir content', (await run('cat /srv/app/hello.txt /srv/app/sub/deep.txt')) === 'hello from the context\ndeep');
  const owner = await run("stat -c '%U %a' /srv/app/hello.txt /srv/app/sub/deep.txt /usr/local/bin/tool.sh");
  ok('COPY owner and mode', owner === 'user 750\nuser 750\nroot 755', owner);
  ok('RUN saw the build env', (await run('cat /srv/app/stamp')) === 'hi s3cret');
  ok('build env does not reach the sandbox', (await run('echo "[$BUILD_SECRET]"')) === '[]');
  ok('last step ran', (await run('cat /srv/app/last')) === 'js');
  ok('python3 -c', (await run("python3 -c 'print(6 * 7)'")) === '42');
  const sudo = await sbx.commands.run('sudo -n true && sudo -n id -un');
  ok('sudo -n true', sudo.exitCode === 0 && sudo.stdout.trim() === 'root', sudo);
  ok('the start command serves in the sandbox', (await run('curl -s http://127.0.0.1:8080/')) === 'served');
  // By headers on the API port, or in domain mode (no E2B_API_URL) at getHost(8080).
  const routed = process.env.E2B_API_URL
    ? await fetch(`${process.env.E2B_API_URL}/`, {
      headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8080', 'X-API-Key': process.env.E2B_API_KEY },
    })
    : await fetch(`https://${sbx.getHost(8080)}/`);
  const body = await routed.text();
  ok('the start command port through the API port', routed.status === 200 && body === 'served\n', [routed.status, body]);
} finally {
  await sbx.kill();
}
fs.rmSync(ctx, { recursive: true, force: true });
console.log(`done template_build.mjs in ${((Date.now() - started) / 1000).toFixed(1)}s`);
