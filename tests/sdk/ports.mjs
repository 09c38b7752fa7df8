// The JS SDK's getHost and a plain fetch to a guest port, in the SDK's default addressing
// (E2B_DOMAIN only; tests/e2e_domain.rs runs it behind nginx with TLS and a resolver for
// *.<domain>): public (no credential) and allowPublicTraffic: false (the traffic token in
// e2b-traffic-access-token). Each checked call prints `ok <call>`.
const { Sandbox } = await import(process.env.AENV_E2B_JS);
const template = process.env.AENV_SDK_TEMPLATE ?? 'base';
const domain = process.env.E2B_DOMAIN;
const PORT = 8080;

function ok(call, condition = true, seen = undefined) {
  if (!condition) throw new Error(`${call}: unexpected ${JSON.stringify(seen)}`);
  console.log(`ok ${call}`);
}

/** busybox httpd in the guest on PORT serving `text`; the URL a browser would open. */
async function serve(sbx, text, headers = {}) {
  await sbx.files.write('/home/user/www/index.html', text);
  await sbx.commands.run(`busybox httpd -f -p ${PORT} -h /home/user/www`, { background: true });
  const url = `https://${sbx.getHost(PORT)}/`;
  for (let i = 0; i < 100; i++) {
    try {
      const r = await fetch(url, { headers });
      await r.arrayBuffer();
      if (r.status === 200) return url;
    } catch { /* not listening yet */ }
    await new Promise((r) => setTimeout(r, 200));
  }
  throw new Error(`${url} never answered`);
}

const pub = await Sandbox.create(template, { timeoutMs: 600_000 });
ok('getHost(port) is <port>-<id>.<domain>', pub.getHost(PORT) === `${PORT}-${pub.sandboxId}.${domain}`, pub.getHost(PORT));
const url = await serve(pub, 'public page\n');
let r = await fetch(url);
ok('fetch(https://getHost(port)) with no credential', r.status === 200 && (await r.text()) === 'public page\n', r.status);
await pub.kill();

const priv = await Sandbox.create(template, { timeoutMs: 600_000, network: { allowPublicTraffic: false } });
const token = priv.trafficAccessToken;
ok('allowPublicTraffic: false gives a trafficAccessToken', typeof token === 'string' && token.length >= 32, token);
const privUrl = await serve(priv, 'private page\n', { 'e2b-traffic-access-token': token });
r = await fetch(privUrl);
await r.arrayBuffer();
ok('private port without the token: 401', r.status === 401, r.status);
r = await fetch(privUrl, { headers: { 'e2b-traffic-access-token': token } });
ok('private port with e2b-traffic-access-token', r.status === 200 && (await r.text()) === 'private page\n', r.status);
await priv.kill();
console.log('done ports.mjs');
