"""Volumes mounted into sandboxes through the python SDK (issue 20 item 4): one volume in
two running sandboxes at once (each sees the other's writes and the content API's), a
16 MiB volume whose overrun is ENOSPC in the guest, 409 on deleting a mounted volume, a
pause and resume with the mount intact, bad mount paths and an unknown volume refused
naming the field, and the files still there through the content API once both sandboxes
are gone. Special files from the guest: mknod of a device on the volume is EPERM (its NFS
server lacks CAP_MKNOD), a FIFO is made, listed as `unknown` and refused (400 naming it)
by the content API's read and write, which never block on it. A snapshot of a sandbox
with a volume holds the volume (409 naming the snapshot on delete, also once its sandbox
is gone); a sandbox created from the snapshot and a fork of that one have it mounted
again. A watch on the mount needs allow_network_mounts (envd 0.6.4) and then sees the
sandbox's own writes. Prints `ok id-volume <id>` for the test."""

import os
import time

import httpx

from e2b import Sandbox, Volume
from e2b.exceptions import SandboxException, VolumeException

from check import TEMPLATE, create, main, ok, raises

os.environ["E2B_VOLUME_API_URL"] = os.environ["E2B_API_URL"]
API = os.environ["E2B_API_URL"]
KEY = {"X-API-Key": os.environ["E2B_API_KEY"]}


def run(sbx, cmd):
    return sbx.commands.run(cmd, user="root").stdout


def content(vol, method, kind, path, data=None):
    headers = {"Authorization": f"Bearer {vol.token}"}
    if method == "PATCH":
        headers["Content-Type"] = "application/json"
    return httpx.request(method, f"{API}/volumecontent/{vol.volume_id}/{kind}", params={"path": path},
                         headers=headers, content=data, timeout=30)


def special_files(vol, sbx):
    """A guest's device nodes and FIFOs on a volume: refused or inert on the host."""
    r = run(sbx, "mknod /mnt/data/null c 1 3 2>&1; echo rc=$?")
    ok("mknod of a device on a volume is EPERM in the guest",
       "rc=1" in r and "not permitted" in r, r)
    run(sbx, "mkfifo /mnt/data/fifo")
    listing = content(vol, "GET", "dir", "/")
    types = {e["name"]: e["type"] for e in listing.json()}
    ok("the FIFO is listed as unknown, no device was made",
       listing.status_code == 200 and types.get("fifo") == "unknown" and "null" not in types, listing.text)
    for method, kind, data in [("GET", "file", None), ("PUT", "file", b"x"), ("PATCH", "path", None)]:
        body = b'{"mode": 384}' if method == "PATCH" else data
        r = content(vol, method, kind, "/fifo", body)
        ok(f"content {method} {kind} of the FIFO is 400 naming it",
           r.status_code == 400 and "/fifo is a FIFO" in r.json()["message"], (r.status_code, r.text))
    ok("the content API removes it", content(vol, "DELETE", "path", "/fifo").status_code == 204)


def watch_on_the_mount(sbx):
    """envd 0.6.4: a watch on a volume's NFS mount needs allow_network_mounts; it then
    sees what this sandbox does there."""
    e = raises("watch_dir of a volume's mount", Exception, lambda: sbx.files.watch_dir("/mnt/data"))
    ok("... refused naming the network mount", "network file system mount (NFS)" in str(e), str(e))
    handle = sbx.files.watch_dir("/mnt/data", allow_network_mounts=True)
    run(sbx, "echo w > /mnt/data/watched.txt")
    seen = []
    for _ in range(50):
        seen += [ev for ev in handle.get_new_events() if ev.name == "watched.txt"]
        if seen:
            break
        time.sleep(0.1)
    ok("with allow_network_mounts the watch sees the sandbox's own write", seen, seen)
    handle.stop()
    run(sbx, "rm /mnt/data/watched.txt")


def snapshot_and_fork(vol, two):
    """A snapshot holds its volumes; its sandboxes and their forks mount them again."""
    snap = two.create_snapshot()
    e = raises("delete a volume a snapshot mounts", VolumeException, lambda: Volume.destroy(vol.volume_id))
    ok("... 409 naming the snapshot", str(e).startswith("409: ") and snap.snapshot_id in str(e), str(e))
    three = Sandbox.create(snap.snapshot_id, timeout=600)
    ok("a sandbox from the snapshot has the volume mounted",
       run(three, "cat /home/user/shared/one.txt") == "from-one\n")
    three.commands.run("echo from-three > /home/user/shared/three.txt")
    ok("... and writes to it", vol.read_file("/three.txt") == "from-three\n")
    forks = three.fork(count=1)
    kid = forks[0]
    ok("fork of it", isinstance(kid, Sandbox), kid)
    ok("the fork reads the volume", run(kid, "cat /home/user/shared/three.txt") == "from-three\n")
    kid.commands.run("echo from-fork > /home/user/shared/fork.txt")
    ok("... its writes reach the other mounts", run(three, "cat /home/user/shared/fork.txt") == "from-fork\n")
    kid.kill()
    three.kill()
    return snap


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
    special_files(vol, one)
    watch_on_the_mount(one)
    snap = snapshot_and_fork(vol, two)

    one.pause()
    vol.write_file("/while-paused.txt", "later")
    one.connect()
    ok("mount after resume", run(one, "cat /mnt/data/while-paused.txt /mnt/data/two.txt")
       == "laterfrom-two\n")

    one.kill()
    two.kill()
    ok("files outlive the sandboxes", vol.read_file("/two.txt") == "from-two\n")
    e = raises("delete the volume its snapshot mounts", VolumeException, lambda: Volume.destroy(vol.volume_id))
    ok("... 409 naming only the snapshot", str(e).startswith("409: ") and snap.snapshot_id in str(e)
       and "mounted by sandbox" not in str(e), str(e))
    ok("delete the snapshot", Sandbox.delete_snapshot(snap.snapshot_id))
    ok("delete unmounted tiny", Volume.destroy(tiny["volumeID"]))
    print(f"ok id-volume {vol.volume_id}", flush=True)


if __name__ == "__main__":
    main(body)
