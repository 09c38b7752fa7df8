"""Sandbox lifecycle through the python SDK: create with envs and metadata, info, list,
timeout, pause -> list shows paused -> connect resumes with files intact, kill, and the
exceptions for a missing sandbox and a wrong API key."""

import os
import time

from e2b import (
    AuthenticationException,
    NotFoundException,
    Sandbox,
    SandboxQuery,
    SandboxState,
)

from check import create, main, ok, raises


def body():
    sbx = create(metadata={"suite": "lifecycle"}, envs={"FROM_CREATE": "created"})
    ok("Sandbox.create(template, metadata, envs, timeout)", bool(sbx.sandbox_id))
    ok("Sandbox.is_running()", sbx.is_running())

    info = sbx.get_info()
    ok("Sandbox.get_info()", info.sandbox_id == sbx.sandbox_id and info.metadata == {"suite": "lifecycle"}, info)
    ok("SandboxInfo.state running", info.state == SandboxState.RUNNING, info.state)

    out = sbx.commands.run("echo $FROM_CREATE")
    ok("create envs reach commands.run", out.stdout == "created\n", out.stdout)

    listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "lifecycle"})).next_items()
    ok("Sandbox.list(metadata=)", [s.sandbox_id for s in listed] == [sbx.sandbox_id], listed)

    metrics = sbx.get_metrics()
    m = metrics[-1] if metrics else None
    ok(
        "Sandbox.get_metrics() is the guest's view",
        m is not None and m.cpu_count >= 1 and 0 <= m.cpu_used_pct <= 100
        and 0 < m.mem_used < m.mem_total and 0 < m.disk_used < m.disk_total,
        metrics,
    )
    # The server here samples every second: a history builds up while the sandbox runs.
    deadline = time.monotonic() + 30
    while len(metrics) < 4 and time.monotonic() < deadline:
        time.sleep(0.5)
        metrics = sbx.get_metrics()
    stamps = [x.timestamp for x in metrics]
    ok("Sandbox.get_metrics() returns the samples of the sandbox's life, oldest first",
       len(metrics) >= 4 and stamps == sorted(stamps) and len(set(stamps)) == len(stamps), stamps)
    later = sbx.get_metrics(start=stamps[2])
    ok("Sandbox.get_metrics(start=) leaves out earlier samples",
       stamps[0] not in [x.timestamp for x in later]
       and all(x.timestamp >= stamps[2].replace(microsecond=0) for x in later), later)
    ok("Sandbox.get_metrics(end=) leaves out later samples",
       [x.timestamp for x in sbx.get_metrics(end=stamps[0])] == stamps[:1]
       or stamps[0].replace(microsecond=0) == stamps[1].replace(microsecond=0))

    sbx.set_timeout(900)
    end = sbx.get_info().end_at
    ok("Sandbox.set_timeout(900)", (end - info.started_at).total_seconds() > 800, end)

    sbx.files.write("/home/user/kept.txt", "survives pause\n")
    ok("files.write before pause")
    sbx.pause()
    ok("Sandbox.pause()")
    ok("is_running() is False while paused", not sbx.is_running())
    kept = sbx.get_metrics()
    time.sleep(2)
    ok("Sandbox.get_metrics() of a paused sandbox: its life so far, no new samples",
       len(kept) >= len(metrics) and sbx.get_metrics() == kept, kept)
    paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
    ok("Sandbox.list(state=[PAUSED]) shows it", [s.sandbox_id for s in paused] == [sbx.sandbox_id], paused)

    again = Sandbox.connect(sbx.sandbox_id)
    ok("Sandbox.connect(id) resumes", again.is_running())
    ok("files intact after resume", again.files.read("/home/user/kept.txt") == "survives pause\n")
    out = again.commands.run("echo $FROM_CREATE")
    ok("create envs after resume", out.stdout == "created\n", out.stdout)
    running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()
    ok("Sandbox.list(state=[RUNNING]) after connect", sbx.sandbox_id in [s.sandbox_id for s in running])

    ok("Sandbox.kill()", again.kill() is True)
    ok("is_running() is False after kill", not again.is_running())
    ok("Sandbox.kill(id) of a killed sandbox is False", Sandbox.kill(sbx.sandbox_id) is False)
    raises("Sandbox.get_info(killed id)", NotFoundException, lambda: Sandbox.get_info(sbx.sandbox_id))
    raises("Sandbox.connect(killed id)", NotFoundException, lambda: Sandbox.connect(sbx.sandbox_id))

    raises(
        "Sandbox.create with a wrong API key",
        AuthenticationException,
        lambda: Sandbox.create("base", api_key="wrong-key-" + "x" * 30),
    )
    raises(
        "Sandbox.list with a wrong API key",
        AuthenticationException,
        lambda: Sandbox.list(api_key="wrong-key-" + "x" * 30).next_items(),
    )
    assert os.environ["E2B_API_KEY"]


main(body)
