"""E2B volumes through the python SDK (issue 20 item 4). Phases, by argv[1]:
`content`: create (bad and taken names refused), the content API (write, read, list with
depth, make_dir, get_info, update_metadata, remove), `..` refused naming `path`, the quota
(a write past it fails with 507 and the volume still answers); prints `ok id-volume <id>`,
`ok id-small <id>` and `ok id-tiny <id>` for the test. `after-restart <id>`: the files written before are there.
`delete <id>`: destroy, then it is gone."""

import os
import sys

import httpx

from e2b import Volume
from e2b.exceptions import AuthenticationException, NotFoundException, VolumeException

from check import main, ok, raises

# The content API is this server too.
os.environ["E2B_VOLUME_API_URL"] = os.environ["E2B_API_URL"]

MB = 1024 * 1024


def content():
    e = raises("create bad name", VolumeException, lambda: Volume.create("no spaces allowed"))
    ok("bad name is 400 naming name", str(e).startswith("400: name"), str(e))
    vol = Volume.create("vol-one")
    ok("create", vol.volume_id and vol.token, vol)
    e = raises("create taken name", VolumeException, lambda: Volume.create("vol-one"))
    ok("taken name is 409 naming name", str(e).startswith("409: name"), str(e))
    ok("list", any(v.volume_id == vol.volume_id for v in Volume.list()))
    info = Volume.get_info(vol.volume_id)
    ok("get_info", info.name == "vol-one" and info.token == vol.token, info)

    st = vol.write_file("/notes/hello.txt", "hello volume", force=True, mode=0o640)
    ok("write_file", st.size == 12 and st.mode == 0o640 and st.type.value == "file", st)
    ok("read_file", vol.read_file("/notes/hello.txt") == "hello volume")
    vol.write_file("/notes/hello.txt", b"overwritten")
    ok("overwrite", vol.read_file("/notes/hello.txt", format="bytes") == b"overwritten")
    d = vol.make_dir("/a/b/c", force=True)
    ok("make_dir", d.type.value == "directory" and d.path == "/a/b/c", d)
    raises("make_dir exists", VolumeException, lambda: vol.make_dir("/a/b/c"))
    raises("make_dir without parents", NotFoundException, lambda: vol.make_dir("/x/y"))
    top = [e.path for e in vol.list("/")]
    ok("list /", top == ["/a", "/notes"], top)
    deep = [e.path for e in vol.list("/", depth=3)]
    ok("list depth 3", deep == ["/a", "/a/b", "/a/b/c", "/notes", "/notes/hello.txt"], deep)
    m = vol.update_metadata("/notes/hello.txt", uid=1000, gid=1000, mode=0o4755)
    ok("update_metadata", (m.uid, m.gid, m.mode) == (1000, 1000, 0o755), m)
    ok("exists", vol.exists("/notes/hello.txt") and not vol.exists("/nope"))
    vol.remove("/a")
    ok("remove", not vol.exists("/a/b/c"))
    raises("read missing", NotFoundException, lambda: vol.read_file("/nope"))
    e = raises("dot-dot", VolumeException, lambda: vol.read_file("/notes/../../etc/passwd"))
    ok("dot-dot is 400 naming path", str(e).startswith("400: path"), str(e))
    bad = Volume(vol.volume_id, vol.name, token="not-the-token")
    raises("wrong token", AuthenticationException, lambda: bad.read_file("/notes/hello.txt"))

    small = Volume.create("vol-small")
    # The quota: 16 MiB (sizeMB is agentenv's; the SDK's create has no size).
    r = httpx.post(
        os.environ["E2B_API_URL"] + "/volumes",
        headers={"X-API-Key": os.environ["E2B_API_KEY"]},
        json={"name": "vol-tiny", "sizeMB": 16},
    )
    ok("create sizeMB", r.status_code == 201, r.text)
    tiny = Volume.connect(r.json()["volumeID"])
    tiny.write_file("/fits.bin", b"\1" * (4 * MB))
    e = raises("write past quota", VolumeException, lambda: tiny.write_file("/big.bin", b"\0" * (20 * MB)))
    ok("quota is 507", str(e).startswith("507: "), str(e))
    ok("volume answers after full", tiny.read_file("/fits.bin", format="bytes") == b"\1" * (4 * MB))
    tiny.remove("/big.bin")
    print(f"ok id-volume {vol.volume_id}", flush=True)
    print(f"ok id-small {small.volume_id}", flush=True)
    print(f"ok id-tiny {tiny.volume_id}", flush=True)


def after_restart(volume_id):
    vol = Volume.connect(volume_id)
    ok("read after restart", vol.read_file("/notes/hello.txt") == "overwritten")


def delete(volume_id):
    ok("destroy", Volume.destroy(volume_id))
    raises("get after destroy", NotFoundException, lambda: Volume.get_info(volume_id))
    ok("destroy again is false", Volume.destroy(volume_id) is False)


if __name__ == "__main__":
    phase = sys.argv[1]
    if phase == "content":
        main(content)
    elif phase == "after-restart":
        main(lambda: after_restart(sys.argv[2]))
    else:
        main(lambda: delete(sys.argv[2]))
