"""commands.run through the python SDK: output, exit codes, cwd, envs, timeout, streaming
callbacks (the first line arrives while the command still runs), background commands
with commands.list / kill, and stdin."""

import time

from e2b import CommandExitException, TimeoutException

from check import create, main, ok, raises


def body():
    sbx = create(envs={"SANDBOX_ENV": "from-create"})
    r = sbx.commands.run("echo out; echo err >&2")
    ok("commands.run stdout/stderr/exit_code", (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0), r)
    e = raises("commands.run exit 3", CommandExitException, lambda: sbx.commands.run("echo bad >&2; exit 3"))
    ok("CommandExitException.exit_code/stderr", (e.exit_code, e.stderr) == (3, "bad\n"), (e.exit_code, e.stderr))
    r = sbx.commands.run("pwd", cwd="/tmp")
    ok("commands.run(cwd=)", r.stdout == "/tmp\n", r.stdout)
    r = sbx.commands.run("echo $SANDBOX_ENV $ONE", envs={"ONE": "per-command"})
    ok("commands.run(envs=) with create envs", r.stdout == "from-create per-command\n", r.stdout)
    raises("commands.run(timeout=1) of sleep 30", TimeoutException, lambda: sbx.commands.run("sleep 30", timeout=1))

    # Streaming: the first line reaches the callback before the command ends.
    seen = []
    started = time.monotonic()
    r = sbx.commands.run(
        "echo first; sleep 3; echo second",
        on_stdout=lambda line: seen.append((time.monotonic() - started, line)),
    )
    first_at = seen[0][0] if seen else None
    ok("commands.run(on_stdout=) streams", len(seen) >= 2 and first_at < 2.5, seen)
    ok("commands.run(on_stdout=) full stdout", r.stdout == "first\nsecond\n", r.stdout)
    errs = []
    sbx.commands.run("echo e1 >&2", on_stderr=errs.append)
    ok("commands.run(on_stderr=)", "".join(errs) == "e1\n", errs)

    # Background, list, kill.
    handle = sbx.commands.run("sleep 300", background=True)
    ok("commands.run(background=True) pid", handle.pid > 0, handle.pid)
    listed = [p.pid for p in sbx.commands.list()]
    ok("commands.list() shows it", handle.pid in listed, listed)
    ok("commands.kill(pid)", sbx.commands.kill(handle.pid) is True)
    raises("handle.wait() of a killed command", CommandExitException, handle.wait)
    listed = [p.pid for p in sbx.commands.list()]
    ok("commands.list() after kill", handle.pid not in listed, listed)
    ok("commands.kill(unknown pid) is False", sbx.commands.kill(999999) is False)

    # Stdin.
    handle = sbx.commands.run("head -n 2", background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "line one\n")
    handle.send_stdin("line two\n")
    r = handle.wait()
    ok("commands.send_stdin / handle.send_stdin", r.stdout == "line one\nline two\n", r.stdout)
    handle = sbx.commands.run("cat", background=True, stdin=True)
    handle.send_stdin("to cat\n")
    sbx.commands.close_stdin(handle.pid)
    r = handle.wait()
    ok("commands.close_stdin ends cat", r.stdout == "to cat\n", r.stdout)
    ok("Sandbox.kill()", sbx.kill())


main(body)
