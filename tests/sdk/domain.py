"""The python SDK in its default addressing (E2B_DOMAIN only; tests/e2e_domain.rs runs it
behind nginx with TLS and a resolver for *.<domain>): the SDK's own URLs, and a guest
HTTP server reached at https://sbx.get_host(port) like a browser would, with no
credential on a public sandbox and with the traffic token on a private one."""

import os

import httpx

from check import create, main, ok

DOMAIN = os.environ["E2B_DOMAIN"]
PORT = 8080


def serve(sbx, text, headers=None):
    """busybox httpd in the guest on PORT, serving `text` at /; its URL once it answers."""
    sbx.files.write("/home/user/www/index.html", text)
    sbx.commands.run(f"busybox httpd -f -p {PORT} -h /home/user/www", background=True)
    url = f"https://{sbx.get_host(PORT)}/"
    for _ in range(100):
        try:
            r = httpx.get(url, headers=headers, timeout=30)
            if r.status_code == 200:
                return url
        except httpx.TransportError:
            pass
        sbx.commands.run("sleep 0.2")
    raise AssertionError(f"{url} never answered")


def body():
    assert not os.environ.get("E2B_API_URL") and not os.environ.get("E2B_SANDBOX_URL")
    sbx = create()
    cfg = sbx.connection_config
    ok("the SDK calls https://api.<domain>", cfg.api_url == f"https://api.{DOMAIN}", cfg.api_url)
    host = sbx.get_host(PORT)
    ok("get_host is <port>-<id>.<domain>", host == f"{PORT}-{sbx.sandbox_id}.{DOMAIN}", host)
    ok("commands.run over https://49983-<id>.<domain>", sbx.commands.run("echo hi").stdout == "hi\n")
    url = serve(sbx, "public page\n")
    r = httpx.get(url, timeout=30)
    ok("public port by https get_host, no credential", r.status_code == 200 and r.text == "public page\n", (r.status_code, r.text))
    sbx.kill()

    sbx = create(network={"allow_public_traffic": False})
    token = sbx.traffic_access_token
    ok("private sandbox has a traffic_access_token", isinstance(token, str) and len(token) >= 32, token)
    url = serve(sbx, "private page\n", {"e2b-traffic-access-token": token})
    r = httpx.get(url, timeout=30)
    ok("private port without the token: 401", r.status_code == 401, r.status_code)
    r = httpx.get(url, headers={"e2b-traffic-access-token": token}, timeout=30)
    ok("private port with the token", r.status_code == 200 and r.text == "private page\n", (r.status_code, r.text))
    sbx.kill()


main(body)
