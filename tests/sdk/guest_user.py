"""A distro image as an E2B guest, through the python SDK on a sandbox the test created
(AENV_SANDBOX_ID): commands and files are the account `user` (uid 1000) in /home/user by
default, with that user's permissions (a write to /root is the SDK's error, 403); sudo
works without a password and answers at once; root is still reachable by name. With AENV_DEFAULT_TEMPLATE=1, a bare Sandbox.create()
(the default template `base`, built by the server at startup) works too."""

import os
import time

from check import main, ok, raises
from e2b import Sandbox, SandboxException


def run(sbx, cmd, **kw):
    r = sbx.commands.run(cmd, **kw)
    return r.stdout.strip()


def body():
    sbx = Sandbox.connect(os.environ["AENV_SANDBOX_ID"])
    who = run(sbx, "id -un; id -u; pwd; echo $HOME")
    ok("commands run as user (1000) in /home/user", who == "user\n1000\n/home/user\n/home/user", who)
    started = time.monotonic()
    r = sbx.commands.run("sudo -n true && sudo -n id -un")
    print(f"latency sudo -n true {time.monotonic() - started:.2f}s", flush=True)
    ok("sudo -n works for user", r.exit_code == 0 and r.stdout.strip() == "root", r)
    ok("python3 runs", run(sbx, "python3 -c 'print(6*7)'") == "42")
    ok("the hostname resolves", run(sbx, "getent hosts $(hostname) >/dev/null && echo yes") == "yes")
    # Supplementary groups reach the processes envd starts (a group-readable file).
    run(sbx, "sudo -n groupadd -g 1500 crew && sudo -n usermod -aG crew user && "
        "echo for-crew | sudo -n tee /srv/crew-only >/dev/null && sudo -n chgrp crew /srv/crew-only && "
        "sudo -n chmod 640 /srv/crew-only")
    groups = run(sbx, "id -Gn; cat /srv/crew-only")
    ok("processes get the user's supplementary groups", groups == "user crew\nfor-crew", groups)

    info = sbx.files.write("notes.txt", "mine\n")
    ok("a relative write lands in the home", info.path == "/home/user/notes.txt", info)
    owner = run(sbx, "stat -c '%U:%G' /home/user/notes.txt && cat /home/user/notes.txt")
    ok("the file is user's and readable by user", owner == "user:user\nmine", owner)
    e = raises("files.write(/root/x) as user", SandboxException, lambda: sbx.files.write("/root/x", "no"))
    ok("the error is a permission error", "403" in str(e) or "ermission" in str(e), str(e))
    ok("nothing was written to /root", run(sbx, "sudo -n test -e /root/x || echo absent") == "absent")
    raises("files.read(/etc/shadow) as user", SandboxException, lambda: sbx.files.read("/etc/shadow"))
    raises("files.make_dir(/root/d) as user", SandboxException, lambda: sbx.files.make_dir("/root/d"))
    sbx.files.write("/root/by-root", "r", user="root")
    ok("root writes /root when asked by name", run(sbx, "cat /root/by-root", user="root") == "r")
    ok("and that file is root's", run(sbx, "stat -c %U /root/by-root", user="root") == "root")

    if os.environ.get("AENV_DEFAULT_TEMPLATE") == "1":
        fresh = Sandbox.create(timeout=60)
        try:
            ok("Sandbox.create() uses base", fresh.get_info().template_id is not None)
            ok("base runs commands as user", run(fresh, "id -un") == "user")
        finally:
            fresh.kill()


if __name__ == "__main__":
    main(body)
