"""Filesystem-only pause through the python SDK (issue 20 item 3): pause(mode="filesystem")
keeps the disk only, GET says `pauseMode: "filesystem"`, connect() cold-boots the sandbox
from that disk with its settings (env, user, network policy): files kept, processes gone,
a new boot id; a full pause says `full` and connect(on_resume="reboot") boots it from its
disk too; snapshots of a filesystem-only paused sandbox are 409; auto_resume with mode
filesystem is refused. The timeout form (on_timeout {"action": "pause", "mode":
"filesystem"}) pauses the same way; that sandbox is left paused for the test (`ok left
<id>`), which checks the host and resumes it across a server restart. Prints `ok cold
<id> <n>` for the test to count the extension's hooks."""

import os
import time

import httpx

from e2b import Sandbox, SandboxState

from check import API, TEMPLATE, main, ok, raises

HEADERS = {"X-API-Key": os.environ["E2B_API_KEY"]}
BOOT_ID = "cat /proc/sys/kernel/random/boot_id"
NOTE = "/home/user/notes.txt"
# Whether a process named sleep runs (by /proc: the guest has no pgrep).
SLEEPING = (
    'for p in /proc/[0-9]*; do [ "$(cat $p/comm 2>/dev/null)" = sleep ] && echo alive && exit 0; '
    "done; echo gone"
)


def detail(sbx_id):
    r = httpx.get(f"{API}/sandboxes/{sbx_id}", headers=HEADERS, timeout=30)
    assert r.status_code == 200, (r.status_code, r.text)
    return r.json()


def wait_paused(sbx, limit=90):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if sbx.get_info().state == SandboxState.PAUSED:
            return True
        time.sleep(0.5)
    return False


def alive(sbx):
    """Whether the background `sleep` runs (by name: a cold boot reuses pids)."""
    return sbx.commands.run(SLEEPING).stdout.strip()


def started(sbx):
    """Waits (bounded) for the background `sleep` to run: its login shell starts first."""
    for _ in range(50):
        if alive(sbx) == "alive":
            return True
        time.sleep(0.2)
    return False


def filesystem_pause():
    sbx = Sandbox.create(
        TEMPLATE,
        timeout=600,
        envs={"GREETING": "kept"},
        network={"deny_out": ["198.51.100.0/24"]},
    )
    sbx.files.write(NOTE, "written before the pause\n")
    sbx.commands.run("sleep 3600", background=True)
    boot = sbx.commands.run(BOOT_ID).stdout.strip()
    ok("a background process runs", started(sbx))

    ok("pause(mode='filesystem')", sbx.pause(mode="filesystem"))
    d = detail(sbx.sandbox_id)
    ok("GET: paused, pauseMode filesystem", d["state"] == "paused" and d["pauseMode"] == "filesystem", d)
    raises("a snapshot of it is refused (409)", Exception, lambda: sbx.create_snapshot())
    r = httpx.post(f"{API}/sandboxes/{sbx.sandbox_id}/fork", headers=HEADERS, json={}, timeout=30)
    ok("a fork of it is 409", r.status_code == 409, (r.status_code, r.text))

    sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
    ok("connect cold-boots it: the file is kept", sbx.files.read(NOTE) == "written before the pause\n")
    ok("... the process is gone", alive(sbx) == "gone")
    new_boot = sbx.commands.run(BOOT_ID).stdout.strip()
    ok("... a new boot id", new_boot and new_boot != boot, (boot, new_boot))
    ok("... its env kept", sbx.commands.run("echo $GREETING").stdout == "kept\n")
    ok("... its user kept", sbx.commands.run("whoami").stdout == "user\n")
    d = detail(sbx.sandbox_id)
    ok("... running, no pauseMode", d["state"] == "running" and "pauseMode" not in d, d)
    ok("... its network policy kept", d["network"].get("denyOut") == ["198.51.100.0/24"], d["network"])
    sbx.files.write(NOTE, "written after the cold boot\n")
    ok("files written after the cold boot", sbx.files.read(NOTE) == "written after the cold boot\n")

    # A full pause says so; on_resume="reboot" boots it from its disk all the same.
    sbx.commands.run("sleep 3600", background=True)
    ok("another background process runs", started(sbx))
    sbx.commands.run("sync")
    boot = new_boot
    ok("pause() (full)", sbx.pause())
    d = detail(sbx.sandbox_id)
    ok("GET: pauseMode full", d["pauseMode"] == "full", d)
    sbx = Sandbox.connect(sbx.sandbox_id, timeout=600, on_resume="reboot")
    ok("connect(on_resume='reboot'): file kept", sbx.files.read(NOTE) == "written after the cold boot\n")
    ok("... process gone, new boot", alive(sbx) == "gone" and sbx.commands.run(BOOT_ID).stdout.strip() != boot)
    ok(f"cold {sbx.sandbox_id} 2")
    sbx.kill()


def refused_combinations():
    r = httpx.post(
        f"{API}/v2/sandboxes",
        headers=HEADERS,
        json={"templateID": TEMPLATE, "autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}},
        timeout=30,
    )
    ok("autoResume with autoPauseMemory false is 400", r.status_code == 400, (r.status_code, r.text))


def timeout_form():
    sbx = Sandbox.create(
        TEMPLATE,
        timeout=600,
        lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}},
    )
    sbx.files.write("/home/user/timeout.txt", "kept across a timeout pause\n")
    sbx.commands.run("sleep 3600", background=True)
    bad = httpx.post(f"{API}/sandboxes/{sbx.sandbox_id}/pause", headers=HEADERS, json={"memory": "no"}, timeout=30)
    ok("pause with a non-boolean memory is 422", bad.status_code == 422, (bad.status_code, bad.text))
    sbx.set_timeout(2)
    ok("the timeout pauses it", wait_paused(sbx))
    d = detail(sbx.sandbox_id)
    ok("GET after the timeout: pauseMode filesystem", d["pauseMode"] == "filesystem", d)
    ok(f"left {sbx.sandbox_id}")


def body():
    filesystem_pause()
    refused_combinations()
    timeout_form()


main(body)
