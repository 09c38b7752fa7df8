"""watch_dir events and the PTY through the python SDK."""

import time

from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

from check import create, main, ok


def wait_for(fn, seconds=15):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.3)
    return fn()


def body():
    sbx = create()
    sbx.files.make_dir("/home/user/w")
    watch = sbx.files.watch_dir("/home/user/w")
    ok("files.watch_dir()")
    sbx.files.write("/home/user/w/new.txt", "x")
    sbx.commands.run("rm /home/user/w/new.txt")
    events = []

    def collect():
        events.extend(watch.get_new_events())
        kinds = {(e.name, e.type) for e in events}
        return ("new.txt", FilesystemEventType.CREATE) in kinds and ("new.txt", FilesystemEventType.REMOVE) in kinds

    ok("WatchHandle.get_new_events() create + remove", wait_for(collect), events)
    watch.stop()
    ok("WatchHandle.stop()")

    out = bytearray()
    pty = sbx.pty.create(PtySize(rows=24, cols=80))
    ok("pty.create(size)", pty.pid > 0, pty.pid)
    sbx.pty.send_stdin(pty.pid, b"echo pty-$((40+2))\n")
    ok("pty.send_stdin()")
    sbx.pty.resize(pty.pid, PtySize(rows=30, cols=100))
    ok("pty.resize()")
    sbx.pty.send_stdin(pty.pid, b"stty size; exit\n")
    result = pty.wait(on_pty=lambda data: out.extend(data))
    text = out.decode(errors="replace")
    ok("pty output echoes the command", "pty-42" in text, text)
    ok("pty sees the new size", "30 100" in text, text)
    ok("pty exits with the shell", result.exit_code == 0, result.exit_code)

    pty = sbx.pty.create(PtySize(rows=24, cols=80))
    ok("pty.kill()", sbx.pty.kill(pty.pid) is True)
    ok("Sandbox.kill()", sbx.kill())


main(body)
