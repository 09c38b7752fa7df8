"""Runs inside the sandbox for tests/sdk/ports.py (started by the template's start
command, tests/e2e_ports.rs): an HTTP server on 8080 that answers
each request with what it saw (path, Host, header names) as JSON, and a WebSocket echo
on 8081 (RFC 6455 handshake, each message sent back unmasked, close answered)."""

import base64
import hashlib
import http.server
import json
import socket
import struct
import threading

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        seen = {
            "path": self.path,
            "host": self.headers.get("Host"),
            "headers": sorted(k.lower() for k in self.headers.keys()),
        }
        body = json.dumps(seen).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def read_frame(f):
    head = f.read(2)
    if len(head) < 2:
        return None, None
    opcode, n = head[0] & 0x0F, head[1] & 0x7F
    if n == 126:
        n = struct.unpack(">H", f.read(2))[0]
    elif n == 127:
        n = struct.unpack(">Q", f.read(8))[0]
    mask = f.read(4) if head[1] & 0x80 else b"\0\0\0\0"
    data = f.read(n)
    return opcode, bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def frame(opcode, data):
    n = len(data)
    if n < 126:
        length = bytes([n])
    elif n < 65536:
        length = b"\x7e" + struct.pack(">H", n)
    else:
        length = b"\x7f" + struct.pack(">Q", n)
    return bytes([0x80 | opcode]) + length + data


def websocket(conn):
    f = conn.makefile("rb")
    key = b""
    while True:
        line = f.readline().strip()
        if not line:
            break
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"sec-websocket-key":
            key = value.strip()
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    conn.sendall(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n"
    )
    while True:
        opcode, data = read_frame(f)
        if opcode is None or opcode == 8:
            if opcode == 8:
                conn.sendall(frame(8, b""))
            break
        conn.sendall(frame(10 if opcode == 9 else opcode, data))
    conn.close()


def websockets():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 8081))
    s.listen(16)
    while True:
        conn, _ = s.accept()
        threading.Thread(target=websocket, args=(conn,), daemon=True).start()


threading.Thread(target=websockets, daemon=True).start()
server = http.server.ThreadingHTTPServer(("0.0.0.0", 8080), Echo)
open("/tmp/ports-ready", "w").close()
server.serve_forever()
