"""Volumes mounted into sandboxes through the python SDK (issue 20 item 4): one volume in
two running sandboxes at once (each sees the other's writes and the content API's), a
16 MiB volume whose overrun is ENOSPC in the guest, 409 on deleting a mounted volume, a
pause and resume with the mount intact, bad mount paths and an unknown volume refused
naming the field, and the files still there through the content API once both sandboxes
are gone. Prints `ok id-volume <id>` for the test."""

import os

import httpx

from e2b import Sandbox, Volume
from e2b.exceptions import SandboxException, VolumeException

from check import TEMPLATE, create, main, ok, raises

os.environ["E2B_VOLUME_API_URL"] = os.environ["E2B_API_URL"]
API = os.environ["E2B_API_URL"]
KEY = {"X-API-Key": os.environ["E2B_API_KEY"]}


def run(sbx, cmd):
    return sbx.commands.run(cmd, user="root").stdout


def body():
    vol = Volume.create("shared-work")
    r = httpx.post(f"{API}/volumes", headers=KEY, json={"name": "tiny", "sizeMB": 16})
    ok("create tiny", r.status_code == 201, r.text)
    tiny = r.json()

    for path, field in [("/etc", "path"), ("/", "path"), ("relative", "path")]:
        e = raises(f"mount at {path!r}", SandboxException,
                   lambda: create(volume_mounts={path: vol}))
        ok(f"mount at {path!r} names volumeMounts[0].{field}",
           f"volumeMounts[0].{field}" in str(e), str(e))
    e = raises("unknown volume", SandboxException,
               lambda: create(volume_mounts={"/mnt/x": "no-such-volume"}))
    ok("unknown volume names volumeMounts[0].name", "volumeMounts[0].name" in str(e), str(e))

    one = create(volume_mounts={"/mnt/data": vol, "/mnt/tiny": "tiny"})
    two = create(volume_mounts={"/home/user/shared": "shared-work"})
    ok("mounted", "nfs4" in run(one, "grep /mnt/data /proc/mounts"))
    info = one.get_info()
    ok("get_info lists volume mounts",
       sorted(m["path"] if isinstance(m, dict) else m.path for m in info.volume_mounts)
       == ["/mnt/data", "/mnt/tiny"], info.volume_mounts)

    one.commands.run("echo from-one > /mnt/data/one.txt", user="root")
    ok("two reads one's write", run(two, "cat /home/user/shared/one.txt") == "from-one\n")
    two.commands.run("echo from-two > /home/user/shared/two.txt")
    ok("one reads two's write", run(one, "cat /mnt/data/two.txt") == "from-two\n")
    ok("content API reads a guest's write", vol.read_file("/one.txt") == "from-one\n")
    vol.write_file("/api.txt", "from-api")
    ok("guest reads the content API's write", run(two, "cat /home/user/shared/api.txt") == "from-api")

    full = one.commands.run(
        "dd if=/dev/zero of=/mnt/tiny/big bs=1M count=32 2>&1; echo rc=$?", user="root")
    ok("quota is ENOSPC in the guest", "No space left on device" in full.stdout
       and "rc=1" in full.stdout, full.stdout)
    run(one, "rm /mnt/tiny/big")

    e = raises("delete mounted volume", VolumeException, lambda: Volume.destroy(vol.volume_id))
    ok("delete mounted is 409", str(e).startswith("409: "), str(e))

    one.pause()
    vol.write_file("/while-paused.txt", "later")
    one.connect()
    ok("mount after resume", run(one, "cat /mnt/data/while-paused.txt /mnt/data/two.txt")
       == "laterfrom-two\n")

    one.kill()
    two.kill()
    ok("files outlive the sandboxes", vol.read_file("/two.txt") == "from-two\n")
    ok("delete unmounted tiny", Volume.destroy(tiny["volumeID"]))
    print(f"ok id-volume {vol.volume_id}", flush=True)


if __name__ == "__main__":
    main(body)
