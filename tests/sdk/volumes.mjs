// A volume through the JS SDK: create, writeFile/readFile through the content API
// (E2B_VOLUME_API_URL, or in domain mode https://api.<domain>, is this server), mounted by a sandbox (volumeMounts) that reads the
// file and writes another, which the content API then reads; destroy. Prints `ok <call>`.
const { Sandbox, Volume } = await import(process.env.AENV_E2B_JS);
// In domain mode (no E2B_API_URL) the SDK's default, https://api.<domain>, is this server.
if (process.env.E2B_API_URL) process.env.E2B_VOLUME_API_URL = process.env.E2B_API_URL;
const template = process.env.AENV_SDK_TEMPLATE ?? 'base';

function ok(call, condition = true, seen = undefined) {
  if (!condition) throw new Error(`${call}: unexpected ${JSON.stringify(seen)}`);
  console.log(`ok ${call}`);
}

const vol = await Volume.create('js-volume');
ok('Volume.create', Boolean(vol.volumeId));
await vol.writeFile('/hello.txt', 'from js');
ok('volume.readFile', (await vol.readFile('/hello.txt')) === 'from js');
const sbx = await Sandbox.create(template, { timeoutMs: 600_000, volumeMounts: { '/mnt/js': vol } });
const r = await sbx.commands.run('cat /mnt/js/hello.txt; echo from-guest > /mnt/js/guest.txt');
ok('guest reads the volume', r.stdout === 'from js', r);
ok('content API reads the guest', (await vol.readFile('/guest.txt')) === 'from-guest\n');
await sbx.kill();
ok('Volume.destroy', await Volume.destroy(vol.volumeId));
