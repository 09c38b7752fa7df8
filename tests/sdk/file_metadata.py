"""envd 0.6.x through the python SDK (issue 20 item 7): the server reports envd 0.6.4, so
the SDK offers file metadata (0.6.2), entry info in watch events (0.6.3) and
allow_network_mounts on watches (0.6.4; a local directory is watched as ever, volumes'
NFS mounts are checked by tests/sdk/volume_mounts.py). files.write(..., metadata=) keeps the map as the file's
user.e2b.* extended attributes (keys lowercased) and get_info, list and the write's answer
return it; bad and oversized metadata is refused; get_info and list agree with the
guest's own `stat` (owner, group, permissions, mtime, symlink target); watch events carry
the entry when asked."""

import calendar
import time

import httpx

from e2b import FileType, Sandbox
from e2b.exceptions import InvalidArgumentException, SandboxException

from check import API, TEMPLATE, main, ok, raises

DIR = "/home/user/meta"


def stat(sbx, path):
    """The guest's `stat` of `path`: owner, group, octal permissions, mtime, `readlink -f`."""
    out = sbx.commands.run(f"stat -c '%U %G %a %Y' {path}; readlink -f {path}").stdout.split("\n")
    owner, group, perm, mtime = out[0].split()
    return owner, group, int(perm, 8), int(mtime), out[1]


def agrees_with_stat(sbx, info, path):
    owner, group, perm, mtime, target = stat(sbx, path)
    seen = (info.owner, info.group, info.mode & 0o7777, calendar.timegm(info.modified_time.utctimetuple()))
    return seen == (owner, group, perm, mtime), (seen, (owner, group, perm, mtime), target)


def upload_raw(sbx, path, headers):
    """A raw upload to envd with extra headers, as the SDK sends it (octet-stream)."""
    h = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": sbx._envd_access_token,
        "Content-Type": "application/octet-stream",
        **headers,
    }
    return httpx.post(f"{API}/files", params={"path": path, "username": "user"}, headers=h, content=b"x", timeout=60)


def body():
    sbx = Sandbox.create(TEMPLATE, timeout=600)
    ok("envdVersion 0.6.4", sbx.get_info().envd_version == "0.6.4", sbx.get_info().envd_version)
    sbx.files.make_dir(DIR)

    written = sbx.files.write(f"{DIR}/a.txt", "alpha\n", metadata={"Owner": "Team A", "stage": "draft-1"})
    want = {"owner": "Team A", "stage": "draft-1"}
    ok("files.write(metadata=) answers it, keys lowercased", written.metadata == want, written.metadata)
    info = sbx.files.get_info(f"{DIR}/a.txt")
    ok("get_info returns the metadata", info.metadata == want, info.metadata)
    sbx.files.write(f"{DIR}/b.txt", "beta\n")
    listed = {e.name: e.metadata for e in sbx.files.list(DIR)}
    ok("list returns each file's metadata", listed == {"a.txt": want, "b.txt": None}, listed)
    sbx.files.write(f"{DIR}/a.txt", "alpha 2\n", metadata={"stage": "final"})
    again = sbx.files.get_info(f"{DIR}/a.txt").metadata
    ok("a rewrite sets the keys it gives, others stay", again == {"owner": "Team A", "stage": "final"}, again)
    ok("the content is the new one", sbx.files.read(f"{DIR}/a.txt") == "alpha 2\n")

    raises("a key outside HTTP token characters (the SDK's check)", InvalidArgumentException,
           lambda: sbx.files.write(f"{DIR}/c.txt", "x", metadata={"a b": "c"}))
    raises("a non-ASCII value (the SDK's check)", InvalidArgumentException,
           lambda: sbx.files.write(f"{DIR}/c.txt", "x", metadata={"k": "é"}))
    raises("33 keys are refused by the guest", SandboxException,
           lambda: sbx.files.write(f"{DIR}/c.txt", "x", metadata={f"k{i}": "v" for i in range(33)}))
    r = upload_raw(sbx, f"{DIR}/d.txt", {"X-Metadata-big": "v" * 1025})
    ok("a 1025-byte value is 400", r.status_code == 400 and "at most 1024" in r.text, (r.status_code, r.text))
    r = upload_raw(sbx, f"{DIR}/d.txt", {"X-Metadata-Ok": "yes"})
    ok("a raw upload's X-Metadata-* header is kept", r.status_code == 200 and r.json()[0]["metadata"] == {"ok": "yes"}, r.text)

    # Stat and ListDir agree with the guest's own stat.
    sbx.commands.run(f"chmod 640 {DIR}/b.txt; ln -s b.txt {DIR}/link")
    good, seen = agrees_with_stat(sbx, sbx.files.get_info(f"{DIR}/b.txt"), f"{DIR}/b.txt")
    ok("get_info: owner, group, permissions, mtime as stat says", good, seen)
    entries = {e.name: e for e in sbx.files.list(DIR)}
    good, seen = agrees_with_stat(sbx, entries["b.txt"], f"{DIR}/b.txt")
    ok("list: the same", good, seen)
    link = sbx.files.get_info(f"{DIR}/link")
    target = stat(sbx, f"{DIR}/link")[4]
    ok("a symlink is a symlink with its target", link.type == FileType.SYMLINK and link.symlink_target == target, (link, target))
    ok("... listed the same", entries["link"].type == FileType.SYMLINK and entries["link"].symlink_target == target, entries["link"])
    root = sbx.files.get_info("/etc/passwd")
    good, seen = agrees_with_stat(sbx, root, "/etc/passwd")
    ok("a root-owned file: root root 644", good and root.owner == "root", seen)

    # Watch events carry the entry (0.6.3).
    handle = sbx.files.watch_dir(DIR, include_entry=True)
    sbx.files.write(f"{DIR}/new.txt", "new\n", metadata={"from": "watch"})
    created = []
    for _ in range(50):
        created += [e for e in handle.get_new_events() if e.name == "new.txt" and e.entry is not None]
        if created:
            break
        time.sleep(0.1)
    ok("a watch event carries the entry", created and created[0].entry.path == f"{DIR}/new.txt", created)
    handle.stop()
    # allow_network_mounts (0.6.4) is taken; on a local directory it changes nothing.
    handle = sbx.files.watch_dir(DIR, allow_network_mounts=True)
    ok("watch_dir(allow_network_mounts=True) of a local directory")
    handle.stop()
    sbx.kill()
    ok("killed")


main(body)
