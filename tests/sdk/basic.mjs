// The JS SDK against agentenv: create, commands.run, files write/read, kill. Each checked
// call prints `ok <call>`. The SDK module comes from AENV_E2B_JS (scripts/setup.sh puts
// it under /opt/agentenv-tests/node).
const { Sandbox, CommandExitError } = await import(process.env.AENV_E2B_JS);
const template = process.env.AENV_SDK_TEMPLATE ?? 'base';

function ok(call, condition = true, seen = undefined) {
  if (!condition) throw new Error(`${call}: unexpected ${JSON.stringify(seen)}`);
  console.log(`ok ${call}`);
}

const sbx = await Sandbox.create(template, {
  timeoutMs: 600_000,
  metadata: { suite: 'js' },
  envs: { FROM_JS: 'js-env' },
});
ok('Sandbox.create(template, {metadata, envs, timeoutMs})', Boolean(sbx.sandboxId));
ok('sandbox.isRunning()', await sbx.isRunning());

const r = await sbx.commands.run('echo $FROM_JS; echo err >&2');
ok('commands.run stdout/stderr/exitCode', r.stdout === 'js-env\n' && r.stderr === 'err\n' && r.exitCode === 0, r);
const lines = [];
await sbx.commands.run('echo a; sleep 1; echo b', { onStdout: (l) => lines.push(l) });
ok('commands.run({onStdout})', lines.join('') === 'a\nb\n', lines);
try {
  await sbx.commands.run('exit 7');
  ok('commands.run exit 7 throws', false);
} catch (e) {
  ok('commands.run exit 7 -> CommandExitError', e instanceof CommandExitError && e.exitCode === 7, String(e));
}

await sbx.files.write('/home/user/js.txt', 'from js\n');
ok('files.write(text)');
ok('files.read(text)', (await sbx.files.read('/home/user/js.txt')) === 'from js\n');
const bytes = new Uint8Array([0, 1, 2, 255]);
await sbx.files.write('/home/user/js.bin', bytes.buffer);
const back = await sbx.files.read('/home/user/js.bin', { format: 'bytes' });
ok("files.read({format: 'bytes'})", Buffer.from(back).equals(Buffer.from(bytes)), Array.from(back));
const listed = await sbx.files.list('/home/user');
ok('files.list()', listed.some((e) => e.name === 'js.txt'), listed.map((e) => e.name));

const events = [];
const watcher = await sbx.files.watchDir('/home/user', (e) => events.push(e));
await sbx.files.write('/home/user/watched.txt', 'w');
for (let i = 0; i < 50 && !events.some((e) => e.name === 'watched.txt'); i++) {
  await new Promise((res) => setTimeout(res, 200));
}
ok('files.watchDir() event', events.some((e) => e.name === 'watched.txt'), events);
await watcher.stop();

const found = await Sandbox.list({ query: { metadata: { suite: 'js' } } }).nextItems();
ok('Sandbox.list({query: {metadata}})', found.some((s) => s.sandboxId === sbx.sandboxId), found);

await sbx.kill();
ok('sandbox.kill()');
ok('sandbox.isRunning() after kill is false', !(await sbx.isRunning()));
