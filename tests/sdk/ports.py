"""Public ports (issue 19 item 3) through the python SDK: a guest HTTP server reached with
no credential by `E2b-Sandbox-Id`/`E2b-Sandbox-Port` and by `Host: sbx.get_host(port)`;
with network={"allow_public_traffic": False} refused without the sandbox's
`traffic_access_token` and served with it, `mask_request_host` as the guest's Host; a
WebSocket echo in the guest through the proxy's tunnel (text, 200 KiB binary, ping,
close), and a quiet one closed by the tunnel's idle limit. The guest program is
tests/sdk/ports_guest.py (python3 of the Debian template, started by its start command)."""

import base64
import hashlib
import os
import socket
import struct
import time

import httpx

from e2b import Sandbox

from check import TEMPLATE, main, ok

API = os.environ["E2B_API_URL"]
API_HOST = API.split("//", 1)[1]
ADDR = (API_HOST.split(":")[0], int(API_HOST.split(":")[1]))
KEY = os.environ["E2B_API_KEY"]
HTTP, WS, ENVD = 8080, 8081, 49983
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def by_header(sbx, port, headers=None, path="/"):
    h = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(port)}
    h.update(headers or {})
    return httpx.get(API + path, headers=h, timeout=60)


def by_host(sbx, port, headers=None, path="/"):
    h = {"Host": sbx.get_host(port)}
    h.update(headers or {})
    return httpx.get(API + path, headers=h, timeout=60)


def wait_servers(sbx, headers):
    """The template started the guest's servers (tests/e2e_ports.rs); a sandbox restored
    from it answers at once, a bounded wait covers its first moments."""
    for _ in range(300):
        if by_header(sbx, HTTP, headers).status_code == 200:
            return
        time.sleep(0.1)
    raise AssertionError("the guest's HTTP server does not answer")


def detail(sbx):
    r = httpx.get(f"{API}/sandboxes/{sbx.sandbox_id}", headers={"X-API-Key": KEY}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def ws_open(headers, path="/echo"):
    s = socket.create_connection(ADDR, timeout=60)
    key = base64.b64encode(os.urandom(16))
    h = {"Host": API_HOST}
    h.update(headers)
    lines = [f"GET {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in h.items()]
    lines += ["Upgrade: websocket", "Connection: Upgrade", f"Sec-WebSocket-Key: {key.decode()}",
              "Sec-WebSocket-Version: 13", "", ""]
    s.sendall("\r\n".join(lines).encode())
    f = s.makefile("rb")
    status = int(f.readline().split()[1])
    seen = {}
    while True:
        line = f.readline().strip()
        if not line:
            break
        name, _, value = line.partition(b":")
        seen[name.strip().lower()] = value.strip()
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    return s, f, status, seen, accept


def ws_send(s, opcode, data):
    mask, n = os.urandom(4), len(data)
    if n < 126:
        length = bytes([0x80 | n])
    elif n < 65536:
        length = b"\xfe" + struct.pack(">H", n)
    else:
        length = b"\xff" + struct.pack(">Q", n)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
    s.sendall(bytes([0x80 | opcode]) + length + mask + masked)


def ws_recv(f):
    head = f.read(2)
    assert len(head) == 2, f"the tunnel closed: {head!r}"
    assert head[1] & 0x80 == 0, "a server frame is never masked"
    n = head[1] & 0x7F
    if n == 126:
        n = struct.unpack(">H", f.read(2))[0]
    elif n == 127:
        n = struct.unpack(">Q", f.read(8))[0]
    return head[0] & 0x0F, f.read(n)


def websocket_echo(headers, via):
    s, f, status, seen, accept = ws_open(headers)
    ok(f"websocket {via}: 101", status == 101, status)
    ok(f"websocket {via}: Sec-WebSocket-Accept from the guest", seen.get(b"sec-websocket-accept") == accept, seen)
    ws_send(s, 1, b"hello through the tunnel")
    ok(f"websocket {via}: text echo", ws_recv(f) == (1, b"hello through the tunnel"))
    blob = os.urandom(200 * 1024)
    ws_send(s, 2, blob)
    ok(f"websocket {via}: 200 KiB binary echo", ws_recv(f) == (2, blob))
    ws_send(s, 9, b"p")
    ok(f"websocket {via}: ping -> pong", ws_recv(f) == (10, b"p"))
    ws_send(s, 8, b"")
    ok(f"websocket {via}: close answered", ws_recv(f)[0] == 8)
    ok(f"websocket {via}: then the connection ends", f.read(1) == b"")
    s.close()


def public_sandbox():
    sbx = Sandbox.create(TEMPLATE, timeout=600)
    ok("public: no traffic_access_token", sbx.traffic_access_token is None, sbx.traffic_access_token)
    wait_servers(sbx, {})
    r = by_header(sbx, HTTP, {"X-Access-Token": "not-a-token", "X-API-Key": "not-a-key"}, "/a?b=1")
    ok("public port by E2b-Sandbox-Id, no credential: 200", r.status_code == 200, r.text)
    seen = r.json()
    ok("the guest sees the path and the client's Host", seen["path"] == "/a?b=1" and seen["host"] == API_HOST, seen)
    withheld = {"x-access-token", "x-api-key", "e2b-sandbox-id", "e2b-sandbox-port"}
    ok("no credential or routing header reaches the guest", not withheld & set(seen["headers"]), seen)
    r = by_host(sbx, HTTP)
    ok("public port by Host get_host(8080), no credential: 200", r.status_code == 200, r.text)
    ok("the guest sees get_host(8080) as Host", r.json()["host"] == sbx.get_host(HTTP), r.json())
    for via, call in [("E2b-Sandbox-Id", by_header), ("Host", by_host)]:
        r = call(sbx, ENVD, path="/health")
        ok(f"envd port by {via} without its token: 401", r.status_code == 401, r.status_code)
    r = by_host(sbx, ENVD, {"X-Access-Token": sbx._envd_access_token}, "/health")
    ok("envd port by Host with its token: 200", r.status_code == 200, r.status_code)
    net = detail(sbx)
    ok("GET: network.allowPublicTraffic true, no trafficAccessToken",
       net["network"] == {"allowPublicTraffic": True} and "trafficAccessToken" not in net, net)
    websocket_echo({"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(WS)}, "by E2b-Sandbox-Id")
    # A tunnel nobody talks on is closed by [api] tunnel_idle_secs (3 s in the test).
    s, f, status, _, _ = ws_open({"Host": sbx.get_host(WS)})
    started = time.monotonic()
    ok("quiet websocket: 101", status == 101, status)
    ok("quiet websocket: closed by the server", f.read(1) == b"")
    print(f"latency quiet websocket closed after {time.monotonic() - started:.1f}s", flush=True)
    s.close()
    sbx.kill()


def private_sandbox():
    sbx = Sandbox.create(
        TEMPLATE,
        timeout=600,
        network={"allow_public_traffic": False, "mask_request_host": "${PORT}-masked.example.test"},
    )
    token = sbx.traffic_access_token
    ok("private: create returns traffic_access_token", isinstance(token, str) and len(token) >= 32, token)
    wait_servers(sbx, {"e2b-traffic-access-token": token})
    for via, call in [("E2b-Sandbox-Id", by_header), ("Host", by_host)]:
        r = call(sbx, HTTP)
        ok(f"private port by {via} without the token: 401", r.status_code == 401, r.text)
        r = call(sbx, HTTP, {"e2b-traffic-access-token": token[:-1] + "x"})
        ok(f"private port by {via} with a wrong token: 401", r.status_code == 401, r.status_code)
        r = call(sbx, HTTP, {"e2b-traffic-access-token": token})
        ok(f"private port by {via} with the token: 200", r.status_code == 200, r.text)
        seen = r.json()
        ok(f"by {via}: the guest sees maskRequestHost with the port", seen["host"] == "8080-masked.example.test", seen)
        ok(f"by {via}: the token does not reach the guest", "e2b-traffic-access-token" not in seen["headers"], seen)
    r = by_header(sbx, ENVD, {"e2b-traffic-access-token": token}, "/health")
    ok("the traffic token does not open envd: 401", r.status_code == 401, r.status_code)
    d = detail(sbx)
    ok("GET: trafficAccessToken and network as created",
       d.get("trafficAccessToken") == token
       and d["network"] == {"allowPublicTraffic": False, "maskRequestHost": "${PORT}-masked.example.test"}, d)
    again = Sandbox.connect(sbx.sandbox_id)
    ok("connect returns the same traffic_access_token", again.traffic_access_token == token)
    s, f, status, _, _ = ws_open({"Host": sbx.get_host(WS)})
    ok("private websocket without the token: 401", status == 401, status)
    s.close()
    websocket_echo({"Host": sbx.get_host(WS), "e2b-traffic-access-token": token}, "by Host with the token")
    sbx.kill()


def body():
    for part in (public_sandbox, private_sandbox):
        started = time.monotonic()
        part()
        print(f"latency {part.__name__} {time.monotonic() - started:.1f}s", flush=True)


main(body)
