"""sandbox.files through the python SDK: text, bytes, a 5 MiB binary round trip, list,
exists, make_dir, rename, remove, get_info, write_files, and a missing file."""

import hashlib
import os

from e2b import FileNotFoundException, NotFoundException
from e2b.sandbox.filesystem.filesystem import FileType, WriteEntry

from check import create, main, ok, raises


def body():
    sbx = create()
    info = sbx.files.write("/home/user/a.txt", "hello\n")
    ok("files.write(text)", info.path == "/home/user/a.txt", info)
    ok("files.read(text)", sbx.files.read("/home/user/a.txt") == "hello\n")
    sbx.files.write("/home/user/b.bin", b"\x00\x01\xffbinary")
    ok("files.read(format='bytes')", bytes(sbx.files.read("/home/user/b.bin", format="bytes")) == b"\x00\x01\xffbinary")

    big = os.urandom(5 * 1024 * 1024)
    sbx.files.write("/home/user/big.bin", big)
    back = bytes(sbx.files.read("/home/user/big.bin", format="bytes"))
    ok("5 MiB binary round trip", hashlib.sha256(back).digest() == hashlib.sha256(big).digest(), len(back))
    r = sbx.commands.run("sha256sum /home/user/big.bin")
    ok("5 MiB binary as the guest sees it", r.stdout.split()[0] == hashlib.sha256(big).hexdigest(), r.stdout)

    ok("files.make_dir(new) is True", sbx.files.make_dir("/home/user/d/e") is True)
    ok("files.make_dir(existing) is False", sbx.files.make_dir("/home/user/d/e") is False)
    sbx.files.write("/home/user/d/one.txt", "1")
    names = sorted(e.name for e in sbx.files.list("/home/user/d"))
    ok("files.list(dir)", names == ["e", "one.txt"], names)
    entries = {e.name: e for e in sbx.files.list("/home/user/d", depth=2)}
    ok("files.list(depth=2)", "e" in entries and entries["e"].type == FileType.DIR, list(entries))
    ok("files.exists(file)", sbx.files.exists("/home/user/d/one.txt"))
    ok("files.exists(missing) is False", not sbx.files.exists("/home/user/nope"))
    st = sbx.files.get_info("/home/user/big.bin")
    ok("files.get_info()", st.size == len(big) and st.type == FileType.FILE and st.name == "big.bin", st)
    moved = sbx.files.rename("/home/user/d/one.txt", "/home/user/d/two.txt")
    ok("files.rename()", moved.path == "/home/user/d/two.txt" and not sbx.files.exists("/home/user/d/one.txt"), moved)
    sbx.files.remove("/home/user/d")
    ok("files.remove(dir)", not sbx.files.exists("/home/user/d"))

    written = sbx.files.write_files(
        [WriteEntry(path="/home/user/m/x.txt", data="x"), WriteEntry(path="/home/user/m/y.bin", data=b"y")]
    )
    ok("files.write_files(two)", sorted(w.path for w in written) == ["/home/user/m/x.txt", "/home/user/m/y.bin"], written)
    ok("files.write_files content", sbx.files.read("/home/user/m/x.txt") == "x")

    raises("files.read(missing)", FileNotFoundException, lambda: sbx.files.read("/home/user/missing.txt"))
    raises("files.get_info(missing)", NotFoundException, lambda: sbx.files.get_info("/home/user/missing.txt"))
    raises("files.list(missing)", NotFoundException, lambda: sbx.files.list("/home/user/missing"))
    ok("Sandbox.kill()", sbx.kill())


main(body)
