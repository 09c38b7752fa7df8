"""The code interpreter SDK (`e2b-code-interpreter`, pinned by scripts/setup.sh) against a
template that serves its protocol on port 49999 (tests/sdk/code_interpreter_guest.py,
started by tests/e2e_ports.rs's template): run_code with stdout, the last expression's
result, errors, envs and state kept between calls; contexts created, listed, used,
restarted and removed; all through agentenv's port routing as the SDK addresses it
(E2b-Sandbox-Id/E2b-Sandbox-Port with the envd token it sends), also on a sandbox with
allow_public_traffic=False, where the SDK's traffic token is what lets it in."""

import os

import httpx
from e2b_code_interpreter import Sandbox

from check import TEMPLATE, main, ok


def wait_ready(sbx):
    """The template started the server; a restored sandbox answers at once."""
    for _ in range(100):
        ex = sbx.run_code("1")
        if ex.text == "1":
            return
    raise AssertionError("the code interpreter never answered")


def checks(sbx, label):
    wait_ready(sbx)
    seen = []
    ex = sbx.run_code("x = 6 * 7\nprint('hello')\nx", on_stdout=lambda m: seen.append(m.line))
    ok(f"{label}: run_code stdout and result", ex.logs.stdout == ["hello\n"] and ex.text == "42", (ex.logs, ex.text))
    ok(f"{label}: run_code(on_stdout)", seen == ["hello\n"], seen)
    ok(f"{label}: state kept between calls", sbx.run_code("x + 1").text == "43")
    ex = sbx.run_code("1 / 0")
    ok(f"{label}: an error is ExecutionError", ex.error is not None and ex.error.name == "ZeroDivisionError", ex.error)
    ex = sbx.run_code("import os\nos.environ['CI_ENV']", envs={"CI_ENV": "from-envs"})
    ok(f"{label}: run_code(envs)", ex.text == "'from-envs'", ex.text)


def body():
    sbx = Sandbox.create(TEMPLATE, timeout=600)
    checks(sbx, "public")
    ctx = sbx.create_code_context(cwd="/tmp")
    ok("create_code_context(cwd)", ctx.id and ctx.language == "python" and ctx.cwd == "/tmp", ctx)
    ex = sbx.run_code("import os\nos.getcwd()", context=ctx)
    ok("run_code(context) runs in its cwd", ex.text == "'/tmp'", ex.text)
    ok("a context has its own namespace", sbx.run_code("x", context=ctx).error.name == "NameError")
    ok("list_code_contexts()", ctx.id in [c.id for c in sbx.list_code_contexts()])
    sbx.run_code("y = 1", context=ctx)
    sbx.restart_code_context(ctx)
    ok("restart_code_context() clears it", sbx.run_code("y", context=ctx).error.name == "NameError")
    sbx.remove_code_context(ctx)
    ok("remove_code_context()", ctx.id not in [c.id for c in sbx.list_code_contexts()])
    sbx.kill()

    sbx = Sandbox.create(TEMPLATE, timeout=600, network={"allow_public_traffic": False})
    checks(sbx, "private")
    api = os.environ["E2B_API_URL"]
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
    r = httpx.post(f"{api}/execute", json={"code": "1"}, headers=headers, timeout=60)
    ok("private: /execute without the traffic token is 401", r.status_code == 401, r.status_code)
    sbx.kill()


main(body)
