"""Auto-resume through the python SDK (issue 20 item 2): a sandbox created with
lifecycle={"on_timeout": "pause", "auto_resume": True} and paused (by pause() and by its
timeout) wakes on a command, a file read, a request to another port and four requests at
once, each served as if it never slept (the background server in it still runs); without
auto_resume a paused sandbox stays paused. Prints `ok woke <id> <n>` for the test to count
the extension's start-resume hooks."""

import concurrent.futures
import time

import httpx

from e2b import Sandbox, SandboxState

from check import API, TEMPLATE, main, ok, raises

PORT = 8080
# The web server's pid, when it still runs.
ALIVE = "kill -0 $(cat /tmp/httpd.pid) && cat /tmp/httpd.pid"


def paused(sbx):
    return sbx.get_info().state == SandboxState.PAUSED


def wait_paused(sbx, limit=90):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if paused(sbx):
            return True
        time.sleep(0.5)
    return False


def port_get(sbx, path):
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "E2b-Sandbox-Port": str(PORT),
        "X-Access-Token": sbx._envd_access_token,
    }
    return httpx.get(API + path, headers=headers, timeout=120)


def body():
    sbx = Sandbox.create(
        TEMPLATE,
        timeout=600,
        lifecycle={"on_timeout": "pause", "auto_resume": True},
    )
    sbx.files.write("/home/user/www/index.html", "served after sleep\n")
    sbx.commands.run(
        f"echo $$ > /tmp/httpd.pid; exec busybox httpd -f -p {PORT} -h /home/user/www", background=True
    )
    for _ in range(100):
        r = port_get(sbx, "/")
        if r.status_code == 200:
            break
        time.sleep(0.1)
    ok("a web server in the sandbox", r.text == "served after sleep\n", (r.status_code, r.text))
    pid = sbx.commands.run(ALIVE).stdout.strip()
    wakes = 0

    sbx.pause()
    ok("pause() -> paused", paused(sbx))
    started = time.monotonic()
    out = sbx.commands.run("echo woken; " + ALIVE)
    wakes += 1
    ok(
        f"commands.run wakes it ({time.monotonic() - started:.1f}s), processes kept",
        out.stdout == f"woken\n{pid}\n",
        out.stdout,
    )
    ok("running after the wake", sbx.get_info().state == SandboxState.RUNNING)

    sbx.pause()
    text = sbx.files.read("/home/user/www/index.html")
    wakes += 1
    ok("files.read wakes it", text == "served after sleep\n", text)

    sbx.pause()
    r = port_get(sbx, "/")
    wakes += 1
    ok("a request to port 8080 wakes it", r.status_code == 200 and r.text == "served after sleep\n", r.text)

    sbx.pause()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: sbx.commands.run(f"echo {i}").stdout, range(4)))
    wakes += 1
    ok("four requests at once share one wake", outs == [f"{i}\n" for i in range(4)], outs)

    # The timeout's pause wakes the same way.
    sbx.set_timeout(2)
    ok("the timeout pauses it", wait_paused(sbx))
    out = sbx.commands.run(ALIVE)
    wakes += 1
    ok("commands.run after a timeout pause wakes it", out.stdout.strip() == pid, out.stdout)
    info = sbx.get_info()
    ok("a wake gives it its timeout again", info.state == SandboxState.RUNNING, info)
    ok(f"woke {sbx.sandbox_id} {wakes}")
    # Stays running for the rest of the script.
    sbx.set_timeout(600)

    plain = Sandbox.create(TEMPLATE, timeout=600, lifecycle={"on_timeout": "pause"})
    plain.pause()
    raises("without auto_resume a paused sandbox is not woken", Exception, lambda: plain.commands.run("true"))
    ok("... and stays paused", paused(plain))
    plain.kill()
    sbx.kill()
    ok("killed")


main(body)
