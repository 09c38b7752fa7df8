"""A small code-interpreter server for a Debian guest (python3's standard library only),
speaking the protocol the `e2b-code-interpreter` SDK calls on port 49999 (read from the
SDK's code_interpreter_sync.py and models.py): POST /execute streams NDJSON lines
(`stdout`, `stderr`, `result`, `error`, `number_of_executions`); POST/GET /contexts,
DELETE /contexts/<id> and POST /contexts/<id>/restart manage contexts, each a python
namespace kept between executions. Python only: other languages are a 400. Started by the
test template's start command (tests/e2e_ports.rs); touches /tmp/code-interpreter-ready
once listening. Not a Jupyter kernel: enough to check the SDK's calls reach a guest
server through agentenv's port routing."""

import ast
import contextlib
import json
import os
import sys
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = 49999
MAX_BODY = 1 << 20


class Context:
    def __init__(self, cwd):
        self.id = str(uuid.uuid4())
        self.cwd = cwd
        self.namespace = {"__name__": "__main__"}
        self.lock = threading.Lock()
        self.count = 0

    def info(self):
        return {"id": self.id, "language": "python", "cwd": self.cwd}


CONTEXTS = {}
DEFAULT = Context("/home/user")
LOCK = threading.Lock()


class Stream:
    """A file-like stdout/stderr that sends each line as one NDJSON message (the rest of
    a line when the cell ends)."""

    def __init__(self, emit, kind):
        self.emit, self.kind, self.buf = emit, kind, ""

    def write(self, text):
        self.buf += text
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self.send(line + "\n")
        return len(text)

    def send(self, text):
        self.emit({"type": self.kind, "text": text, "timestamp": time.time_ns()})

    def flush(self):
        pass

    def close(self):
        if self.buf:
            self.send(self.buf)
            self.buf = ""


def run(ctx, code, env_vars, emit):
    """Runs `code` in the context; the value of a last expression is the main result."""
    with ctx.lock:
        ctx.count += 1
        saved = dict(os.environ)
        os.environ.update(env_vars or {})
        try:
            out, err = Stream(emit, "stdout"), Stream(emit, "stderr")
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.closing(out), contextlib.closing(err):
                os.chdir(ctx.cwd)
                tree = ast.parse(code, "<cell>", "exec")
                last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
                exec(compile(tree, "<cell>", "exec"), ctx.namespace)
                if last is not None:
                    value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), ctx.namespace)
                    if value is not None:
                        emit({"type": "result", "text": repr(value), "is_main_result": True})
        except Exception as e:  # noqa: BLE001 - the cell's error goes to the client
            emit({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": traceback.format_exc()})
        finally:
            os.environ.clear()
            os.environ.update(saved)
        emit({"type": "number_of_executions", "execution_count": ctx.count})


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError("body too large")
        return json.loads(self.rfile.read(n) or b"{}")

    def answer(self, status, value):
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def context(self, context_id, language):
        if language not in (None, "python"):
            return None, f"language {language!r} is not served here (python only)"
        if context_id is None:
            return DEFAULT, None
        with LOCK:
            ctx = CONTEXTS.get(context_id)
        return ctx, None if ctx else f"context {context_id} not found"

    def do_POST(self):
        req = self.body()
        parts = self.path.strip("/").split("/")
        if parts == ["execute"]:
            return self.execute(req)
        if parts == ["contexts"]:
            language = req.get("language")
            if language not in (None, "python"):
                return self.answer(400, {"error": f"language {language!r} is not served here"})
            ctx = Context(req.get("cwd") or "/home/user")
            with LOCK:
                CONTEXTS[ctx.id] = ctx
            return self.answer(200, ctx.info())
        if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
            with LOCK:
                old = CONTEXTS.get(parts[1])
                if old:
                    old.namespace = {"__name__": "__main__"}
            return self.answer(200 if old else 404, {} if old else {"error": "not found"})
        self.answer(404, {"error": "not found"})

    def do_GET(self):
        if self.path.rstrip("/") == "/contexts":
            with LOCK:
                return self.answer(200, [c.info() for c in CONTEXTS.values()])
        if self.path == "/health":
            return self.answer(200, {"status": "ok"})
        self.answer(404, {"error": "not found"})

    def do_DELETE(self):
        parts = self.path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "contexts":
            with LOCK:
                gone = CONTEXTS.pop(parts[1], None)
            if gone:
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        self.answer(404, {"error": "not found"})

    def execute(self, req):
        ctx, why = self.context(req.get("context_id"), req.get("language"))
        if ctx is None:
            return self.answer(404 if "not found" in why else 400, {"error": why})
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def emit(message):
            line = json.dumps(message).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()

        run(ctx, req.get("code") or "", req.get("env_vars"), emit)
        self.wfile.write(b"0\r\n\r\n")


def main():
    server = ThreadingHTTPServer(("0.0.0.0", PORT), Handler)
    open("/tmp/code-interpreter-ready", "w").close()
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
