#!/usr/bin/env bash
# Builds the guest initramfs: /init = the static agent, plus the virtio modules it loads
# (in /lib/modules/order's order) before the root disk and the NIC exist.
#
# usage: build-initramfs.sh <agent-binary> <kernel-modules-dir (.../lib/modules/VER)> <out.img>
# The output is a gzip-compressed newc cpio archive.
set -euo pipefail

if [ "$#" -ne 3 ]; then
    echo "usage: $0 <agent-binary> <kernel-modules-dir> <out.img>" >&2
    exit 2
fi
agent=$1
moddir=$2
out=$3
# The NFS client (sunrpc … nfsv4, in dependency order) mounts the sandbox's volumes from
# its slot's NFS server (docs/operations.md §11).
modules="virtio_ring virtio virtio_mmio virtio_blk failover net_failover virtio_net virtio_console sunrpc grace lockd netfs fscache nfs dns_resolver nfsv4"

[ -f "$agent" ] || { echo "agent binary $agent not found" >&2; exit 1; }
[ -d "$moddir" ] || { echo "modules dir $moddir not found" >&2; exit 1; }

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib/modules" "$stage/dev" "$stage/proc" "$stage/sys" "$stage/newroot"
install -m 0755 "$agent" "$stage/init"
: > "$stage/lib/modules/order"
for m in $modules; do
    ko=$(find "$moddir" -name "$m.ko" -type f | head -n 1)
    if [ -z "$ko" ]; then
        echo "module $m.ko not found under $moddir (compressed modules are not supported)" >&2
        exit 1
    fi
    install -m 0644 "$ko" "$stage/lib/modules/$m.ko"
    echo "$m" >> "$stage/lib/modules/order"
done

# Explicit, sorted file list; paths are relative to the staging dir. The archive is
# gzip-compressed (half the size to load) and zero-padded to a multiple of 4 KiB: with
# some initramfs sizes that are not a whole number of pages, a PVH boot of the guest
# kernel under QEMU microvm hangs at "ACPI: Core revision" (seen with 4862464 and
# 2039137 bytes; the same files padded to 4 KiB boot). The kernel skips zero padding
# after an archive.
tmp_out="$out.tmp.$$"
(cd "$stage" && find . -mindepth 1 | sed "s|^\./||" | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) | gzip -1 > "$tmp_out"
size=$(wc -c < "$tmp_out")
truncate -s $(( (size + 4095) / 4096 * 4096 )) "$tmp_out"
mv "$tmp_out" "$out"
echo "wrote $out ($(wc -c < "$out") bytes)" >&2
