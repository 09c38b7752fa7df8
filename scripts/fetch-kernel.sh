#!/usr/bin/env bash
# Fetches Debian's current cloud kernel as a guest-kernel artifact, never installing it as
# the host's kernel.
#
# Usage: scripts/fetch-kernel.sh <assets_dir>
#
# Places:
#   <assets_dir>/vmlinuz          the bzImage
#   <assets_dir>/vmlinux          a PVH ELF extracted from it (only when `lz4` is installed;
#                                 boots faster under microvm, and is preferred when present)
#   <assets_dir>/modules/         the lib/modules/<version> tree
#   <assets_dir>/kernel-version   the version string, e.g. 6.1.0-57-cloud-amd64
#
# Idempotent: when kernel-version already names the current version and the files are in
# place, nothing is downloaded.
set -euo pipefail

die() {
    echo "fetch-kernel: error: $*" >&2
    exit 1
}
say() { echo "fetch-kernel: $*"; }

[ $# -eq 1 ] || die "usage: $0 <assets_dir>"
assets=$1
mkdir -p "$assets" || die "cannot create $assets"
assets=$(cd "$assets" && pwd)

command -v apt-cache >/dev/null || die "apt-cache not found: this script needs a Debian host"
command -v dpkg-deb >/dev/null || die "dpkg-deb not found: this script needs a Debian host"

# The meta package depends on exactly one versioned image; the name changes with point
# releases, so resolve it every time.
pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null |
    sed -n 's/^ *Depends: \(linux-image-[0-9].*-cloud-amd64\)$/\1/p' | head -n1)
[ -n "$pkg" ] || die "cannot resolve the package behind linux-image-cloud-amd64; run 'apt-get update' (and check that Debian main is in the apt sources)"
version=${pkg#linux-image-}
say "current cloud kernel: $pkg"

# Extracts a PVH vmlinux (an ELF with the Xen PVH entry note) from a bzImage: the setup
# code is (setup_sects + 1) * 512 bytes (setup_sects at 0x1f1), the compressed payload
# starts payload_offset (0x248) bytes after it and is payload_length (0x24c) bytes long.
# Debian compresses it with LZ4 and the kernel build appends the 4-byte decompressed size.
# Prints `count` bytes of `file` from byte `offset` (no SIGPIPE games under pipefail).
bytes() {
    dd if="$1" bs=1M iflag=skip_bytes,count_bytes skip="$2" count="$3" status=none
}

extract_vmlinux() {
    local bz=$1 out=$2
    local setup off len start size
    setup=$(od -An -tu1 -j $((0x1f1)) -N1 "$bz" | tr -d ' ')
    off=$(od -An -tu4 -j $((0x248)) -N4 "$bz" | tr -d ' ')
    len=$(od -An -tu4 -j $((0x24c)) -N4 "$bz" | tr -d ' ')
    [ "$setup" -eq 0 ] && setup=4
    start=$(((setup + 1) * 512 + off))
    local tmpfile="$out.tmp.$$"
    # LZ4 legacy frames start with 02 21 4c 18.
    if [ "$(bytes "$bz" "$start" 4 | od -An -tx1 | tr -d ' ')" != "02214c18" ]; then
        say "the kernel payload is not LZ4; skipping vmlinux (vmlinuz still works)"
        return 0
    fi
    size=$(bytes "$bz" $((start + len - 4)) 4 | od -An -tu4 | tr -d ' ')
    if ! bytes "$bz" "$start" $((len - 4)) | lz4 -d -c >"$tmpfile" 2>/dev/null; then
        rm -f "$tmpfile"
        die "lz4 could not decompress the kernel payload of $bz"
    fi
    if [ "$(stat -c %s "$tmpfile")" != "$size" ] || [ "$(bytes "$tmpfile" 0 4 | od -An -tx1 | tr -d ' ')" != "7f454c46" ]; then
        rm -f "$tmpfile"
        die "the decompressed kernel payload of $bz is not the expected ELF image"
    fi
    mv -f "$tmpfile" "$out"
    say "extracted PVH vmlinux ($size bytes)"
}

have_all() {
    [ "$(cat "$assets/kernel-version" 2>/dev/null)" = "$version" ] &&
        [ -s "$assets/vmlinuz" ] && [ -d "$assets/modules/kernel" ]
}

if have_all; then
    say "$assets already holds $version"
else
    # apt drops privileges to _apt for downloads: use a directory it can write.
    work=$(mktemp -d /tmp/agentenv-kernel.XXXXXX) || die "cannot create a temporary directory"
    trap 'rm -rf "$work"' EXIT
    chmod 0755 "$work"
    chown _apt "$work" 2>/dev/null || true
    say "downloading $pkg"
    if ! (cd "$work" && apt-get download -q "$pkg" >"$work/download.log" 2>&1); then
        cat "$work/download.log" >&2
        die "apt-get download $pkg failed; run 'apt-get update' and retry"
    fi
    deb=$(ls "$work"/*.deb 2>/dev/null | head -n1)
    [ -n "$deb" ] || die "apt-get download produced no .deb in $work"
    dpkg-deb -x "$deb" "$work/x" || die "dpkg-deb could not unpack $deb"
    [ -s "$work/x/boot/vmlinuz-$version" ] || die "$deb holds no boot/vmlinuz-$version"
    [ -d "$work/x/lib/modules/$version/kernel" ] || die "$deb holds no lib/modules/$version/kernel"

    # Replace atomically enough: stage next to the destination, then rename.
    cp -f "$work/x/boot/vmlinuz-$version" "$assets/vmlinuz.tmp"
    mv -f "$assets/vmlinuz.tmp" "$assets/vmlinuz"
    rm -rf "$assets/modules.tmp" "$assets/modules.old"
    mv "$work/x/lib/modules/$version" "$assets/modules.tmp"
    [ -e "$assets/modules" ] && mv "$assets/modules" "$assets/modules.old"
    mv "$assets/modules.tmp" "$assets/modules"
    rm -rf "$assets/modules.old" "$assets/vmlinux"
    echo "$version" >"$assets/kernel-version"
    say "placed $assets/vmlinuz and $assets/modules/ ($version)"
fi

if [ -s "$assets/vmlinux" ] && [ "$assets/vmlinux" -nt "$assets/vmlinuz" ]; then
    say "$assets/vmlinux is up to date"
elif command -v lz4 >/dev/null; then
    extract_vmlinux "$assets/vmlinuz" "$assets/vmlinux"
else
    say "lz4 not installed (Debian package lz4): skipping the PVH vmlinux; vmlinuz is used"
fi
say "done"
