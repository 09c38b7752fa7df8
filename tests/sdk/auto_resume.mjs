// Auto-resume through the JS SDK (issue 20 item 2): a sandbox created with
// lifecycle {onTimeout: 'pause', autoResume: true} and paused wakes on commands.run and
// files.read, its processes kept. Each checked call prints `ok <call>`; `ok woke <id> <n>`
// lets the test count the extension's start-resume hooks.
const { Sandbox } = await import(process.env.AENV_E2B_JS);
const template = process.env.AENV_SDK_TEMPLATE ?? 'base';

function ok(call, condition = true, seen = undefined) {
  if (!condition) throw new Error(`${call}: unexpected ${JSON.stringify(seen)}`);
  console.log(`ok ${call}`);
}

const sbx = await Sandbox.create(template, {
  timeoutMs: 600_000,
  lifecycle: { onTimeout: 'pause', autoResume: true },
});
const info = await sbx.getInfo();
ok('getInfo().lifecycle', info.lifecycle?.onTimeout === 'pause' && info.lifecycle?.autoResume === true, info.lifecycle);
await sbx.commands.run('sleep 3600', { background: true });
const pid = (await sbx.commands.run('pidof sleep')).stdout.trim();

await sbx.pause();
ok('pause() -> paused', (await sbx.getInfo()).state === 'paused');
const r = await sbx.commands.run('echo woken; pidof sleep');
ok('commands.run wakes it, processes kept', r.stdout === `woken\n${pid}\n`, r.stdout);

await sbx.files.write('/home/user/js.txt', 'from js');
await sbx.pause();
const text = await sbx.files.read('/home/user/js.txt');
ok('files.read wakes it', text === 'from js', text);
ok('running after the wake', (await sbx.getInfo()).state === 'running');
ok(`woke ${sbx.sandboxId} 2`);

await sbx.kill();
ok('kill');
