"""Volumes through sandbox lifecycles, python SDK (issue 20 review items 3 and 5). Phases,
by argv[1]:
`before-restart`: a sandbox whose image has no `mount` program (removed from its disk)
pauses filesystem-only and resumes: booted from its disk, the agent mounts the volume
again itself (mount(2)), the data written before and during the pause is there, writes go
on; then a second sandbox writes to the volume and is left running for the server's
restart; prints `ok id-volume <id>` and `ok id-sandbox <id>`.
`after-restart <volume> <sandbox>`: the sandbox (paused by the graceful stop) resumes with
the volume mounted, its data there and new writes reaching the content API; then it is
killed and the volume deleted."""

import os
import sys

from e2b import Sandbox, Volume

from check import create, main, ok

os.environ["E2B_VOLUME_API_URL"] = os.environ["E2B_API_URL"]
NO_MOUNT = "rm -f /bin/mount /sbin/mount /usr/bin/mount /usr/sbin/mount; command -v mount; echo rc=$?"


def run(sbx, cmd):
    return sbx.commands.run(cmd, user="root").stdout


def mounted(sbx, path):
    return any(line.split()[1:3] == [path, "nfs4"] for line in run(sbx, "cat /proc/mounts").splitlines())


def filesystem_pause(vol):
    sbx = create(volume_mounts={"/mnt/work": vol})
    ok("the image's mount program is gone", run(sbx, NO_MOUNT).strip() == "rc=1")
    run(sbx, "echo before > /mnt/work/fs.txt")
    ok("pause(mode='filesystem')", sbx.pause(mode="filesystem"))
    vol.write_file("/while-paused.txt", "later")
    sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
    ok("booted from disk, the volume is mounted again", mounted(sbx, "/mnt/work"))
    ok("... with no mount program in the image", run(sbx, "command -v mount; echo rc=$?").strip() == "rc=1")
    ok("... its data there", run(sbx, "cat /mnt/work/fs.txt /mnt/work/while-paused.txt") == "before\nlater")
    run(sbx, "echo after > /mnt/work/after.txt")
    ok("... its writes reach the content API", vol.read_file("/after.txt") == "after\n")
    sbx.kill()


def before_restart():
    vol = Volume.create("lasting")
    filesystem_pause(vol)
    sbx = create(volume_mounts={"/mnt/keep": vol})
    run(sbx, "echo kept > /mnt/keep/kept.txt")
    print(f"ok id-volume {vol.volume_id}", flush=True)
    print(f"ok id-sandbox {sbx.sandbox_id}", flush=True)


def after_restart(vol_id, sbx_id):
    vol = Volume.connect(vol_id)
    sbx = Sandbox.connect(sbx_id, timeout=600)
    ok("after the restart the sandbox has the volume mounted", mounted(sbx, "/mnt/keep"))
    ok("... its data there", run(sbx, "cat /mnt/keep/kept.txt") == "kept\n")
    run(sbx, "echo again > /mnt/keep/again.txt")
    ok("... its writes reach the content API", vol.read_file("/again.txt") == "again\n")
    sbx.kill()
    ok("delete the volume", Volume.destroy(vol_id))


if __name__ == "__main__":
    phase = sys.argv[1]
    if phase == "before-restart":
        main(before_restart)
    elif phase == "after-restart":
        main(lambda: after_restart(sys.argv[2], sys.argv[3]))
    else:
        raise SystemExit(f"unknown phase {phase}")
