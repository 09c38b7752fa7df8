"""Signed file URLs (issue 19 item 5) through the python SDK: `download_url` and
`upload_url`, with and without `use_signature_expiration`, fetched by a plain HTTP client
with no header (setup 1: the URL names no sandbox, the server finds the one whose token
signed it); a changed path, user, operation or expiry is 401, an expired URL 403. Prints
the URLs' signatures as `secret <sig>` for the test to look for in the server log."""

import time
import urllib.parse

import httpx

from e2b import Sandbox

from check import TEMPLATE, main, ok

FILE = "/home/user/signed.txt"


def change(url, **params):
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    query.update(params)
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


def query(url):
    return dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))


def body():
    sbx = Sandbox.create(TEMPLATE, timeout=600)
    sbx.files.write(FILE, "signed content\n")
    url = sbx.download_url(FILE)
    print(f"secret {query(url)['signature']}", flush=True)
    ok("download_url carries a v1 signature", query(url)["signature"].startswith("v1_"), url)
    r = httpx.get(url, timeout=60)
    ok("download_url with no header: 200 and the file", r.status_code == 200 and r.text == "signed content\n", (r.status_code, r.text))
    timed = sbx.download_url(FILE, use_signature_expiration=120)
    print(f"secret {query(timed)['signature']}", flush=True)
    r = httpx.get(timed, timeout=60)
    ok("download_url(use_signature_expiration=120): 200", r.status_code == 200 and r.text == "signed content\n", r.status_code)

    up = sbx.upload_url("/home/user/uploaded.txt")
    print(f"secret {query(up)['signature']}", flush=True)
    r = httpx.post(up, files={"file": ("uploaded.txt", b"sent by a browser\n")}, timeout=60)
    ok("upload_url with no header: 200", r.status_code == 200, (r.status_code, r.text))
    ok("the upload is in the sandbox", sbx.files.read("/home/user/uploaded.txt") == "sent by a browser\n")
    up_timed = sbx.upload_url("/home/user/uploaded2.txt", use_signature_expiration=120)
    r = httpx.post(up_timed, files={"file": ("u.txt", b"two\n")}, timeout=60)
    ok("upload_url(use_signature_expiration=120): 200", r.status_code == 200 and sbx.files.read("/home/user/uploaded2.txt") == "two\n", r.status_code)

    tampered = {
        "changed path": change(url, path="/etc/passwd"),
        "changed user": change(url, username="root"),
        "changed expiry": change(timed, signature_expiration=str(int(query(timed)["signature_expiration"]) + 3600)),
        "expiry removed": urllib.parse.urlunsplit(urllib.parse.urlsplit(timed)._replace(
            query=urllib.parse.urlencode({k: v for k, v in query(timed).items() if k != "signature_expiration"}))),
        "changed signature": change(url, signature=query(url)["signature"][:-2] + "AA"),
    }
    for what, bad in tampered.items():
        r = httpx.get(bad, timeout=60)
        ok(f"{what}: 401", r.status_code == 401, (r.status_code, r.text))
    r = httpx.post(url, files={"file": ("x", b"x")}, timeout=60)
    ok("a download URL used to upload (operation changed): 401", r.status_code == 401, r.status_code)
    r = httpx.get(up, timeout=60)
    ok("an upload URL used to download: 401", r.status_code == 401, r.status_code)
    r = httpx.get(change(url, signature=""), timeout=60)
    ok("no signature, no header: refused", r.status_code in (401, 404), r.status_code)

    short = sbx.download_url(FILE, use_signature_expiration=1)
    print(f"secret {query(short)['signature']}", flush=True)
    time.sleep(2.5)
    r = httpx.get(short, timeout=60)
    ok("an expired URL: 403", r.status_code == 403, (r.status_code, r.text))

    # The other addressing: Host <port>-<id>.<domain> with the same signed query.
    r = httpx.get(url, headers={"Host": sbx.get_host(49983)}, timeout=60)
    ok("download_url by Host: 200", r.status_code == 200 and r.text == "signed content\n", r.status_code)
    other = Sandbox.create(TEMPLATE, timeout=600)
    r = httpx.get(url, headers={"Host": other.get_host(49983)}, timeout=60)
    ok("one sandbox's URL sent to another: 401", r.status_code == 401, r.status_code)
    other.kill()
    sbx.kill()
    r = httpx.get(url, timeout=60)
    ok("the URL of a killed sandbox: 401", r.status_code == 401, r.status_code)


main(body)
