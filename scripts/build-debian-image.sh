#!/usr/bin/env bash
# Builds the Debian 12 (bookworm) test image with debootstrap and writes it as an OCI
# layout (one gzip layer), cached: a second run with the same inputs only checks the stamp.
#   scripts/build-debian-image.sh [OUT_DIR]
# OUT_DIR defaults to $AENV_TEST_IMAGES_DIR/debian-12 (AENV_TEST_IMAGES_DIR defaults to
# /var/lib/agentenv/test-images). Use it as `oci:$OUT_DIR` or push it to a registry with
# `skopeo copy oci:$OUT_DIR docker://...`. The image deliberately has no account `user`:
# agentenv adds it to every rootfs that lacks it (docs/e2b.md, "Real distro images").
# The mirror is the one the host's apt uses for bookworm (`apt-get indextargets`), never a
# hard-coded host. Needs root, debootstrap, tar, gzip, sha256sum.
set -euo pipefail

# iproute2 (ss), procps (pgrep) and curl: the E2B SDKs' ready commands (wait_for_port,
# wait_for_process, wait_for_url) run them in the build VM.
PACKAGES=python3,bash,sudo,curl,ca-certificates,iproute2,procps
SUITE=bookworm
# Bump when the steps below change what the image holds.
RECIPE=2
# Entries are stamped with this time, so the same root gives the same layer digest.
MTIME=1700000000

die() { printf 'build-debian-image: %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (debootstrap needs it)"
command -v debootstrap >/dev/null || die "debootstrap not found: apt-get install debootstrap"

OUT=${1:-${AENV_TEST_IMAGES_DIR:-/var/lib/agentenv/test-images}/debian-12}
STAMP_WANT="recipe=$RECIPE suite=$SUITE packages=$PACKAGES"
mkdir -p "$(dirname "$OUT")"
# Test binaries run in parallel: one builds, the others wait and find it cached.
exec 9>"$OUT.lock"
flock 9
if [ -f "$OUT/index.json" ] && [ "$(cat "$OUT/agentenv-stamp" 2>/dev/null)" = "$STAMP_WANT" ]; then
  printf 'build-debian-image: cached in %s\n' "$OUT"
  exit 0
fi

# The host's own mirror for the suite: the first apt source serving bookworm's Packages.
MIRROR=$(apt-get indextargets --format '$(SITE) $(RELEASE) $(IDENTIFIER)' 2>/dev/null \
  | awk -v s="$SUITE" '$2 == s && $3 == "Packages" { print $1; exit }')
[ -n "$MIRROR" ] || die "no apt source for '$SUITE' in the host's apt configuration (run apt-get update, or add one)"

WORK=$(mktemp -d "$(dirname "$OUT")/.debian-build.XXXXXX")
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT
ROOTFS=$WORK/root
printf 'build-debian-image: debootstrap %s from %s\n' "$SUITE" "$MIRROR"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
  || { tail -n 30 "$WORK/debootstrap.log" >&2; die "debootstrap failed (log above)"; }

# Apt inside the guest uses the same mirror; caches, logs and device nodes stay out (the
# guest's PID 1 mounts devtmpfs on /dev).
printf 'deb %s %s main\n' "$MIRROR" "$SUITE" >"$ROOTFS/etc/apt/sources.list"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/log/*.log \
  "$ROOTFS"/var/cache/ldconfig/aux-cache "$ROOTFS"/dev/*
find "$ROOTFS/var/lib/apt/lists" -type f -delete
printf 'debian\n' >"$ROOTFS/etc/hostname"

BLOBS=$WORK/oci/blobs/sha256
mkdir -p "$BLOBS"
tar --numeric-owner --sort=name --mtime="@$MTIME" --xattrs --xattrs-include='security.capability' \
  -C "$ROOTFS" -cf "$WORK/layer.tar" .
DIFF_ID=$(sha256sum "$WORK/layer.tar" | cut -d' ' -f1)
gzip -n -6 -c "$WORK/layer.tar" >"$WORK/layer.tar.gz"
LAYER=$(sha256sum "$WORK/layer.tar.gz" | cut -d' ' -f1)
LAYER_SIZE=$(stat -c %s "$WORK/layer.tar.gz")
mv "$WORK/layer.tar.gz" "$BLOBS/$LAYER"

# One blob per JSON document; its digest names it.
put_blob() {
  local digest
  printf '%s' "$1" >"$WORK/blob"
  digest=$(sha256sum "$WORK/blob" | cut -d' ' -f1)
  mv "$WORK/blob" "$BLOBS/$digest"
  printf '%s %s\n' "$digest" "$(stat -c %s "$BLOBS/$digest")"
}
PATH_ENV=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
read -r CONFIG CONFIG_SIZE < <(put_blob "{\"architecture\":\"amd64\",\"os\":\"linux\",\
\"config\":{\"Env\":[\"PATH=$PATH_ENV\",\"LANG=C.UTF-8\"],\"Cmd\":[\"/bin/bash\"]},\
\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[\"sha256:$DIFF_ID\"]},\
\"history\":[{\"created_by\":\"debootstrap --variant=minbase --include=$PACKAGES $SUITE\"}]}")
read -r MANIFEST MANIFEST_SIZE < <(put_blob "{\"schemaVersion\":2,\
\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\
\"config\":{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:$CONFIG\",\"size\":$CONFIG_SIZE},\
\"layers\":[{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+gzip\",\"digest\":\"sha256:$LAYER\",\"size\":$LAYER_SIZE}]}")
printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.ref.name":"12"}}]}' \
  "$MANIFEST" "$MANIFEST_SIZE" >"$WORK/oci/index.json"
printf '{"imageLayoutVersion":"1.0.0"}' >"$WORK/oci/oci-layout"
printf '%s' "$STAMP_WANT" >"$WORK/oci/agentenv-stamp"

rm -rf "$OUT.old"
[ -e "$OUT" ] && mv "$OUT" "$OUT.old"
mv "$WORK/oci" "$OUT"
rm -rf "$OUT.old"
printf 'build-debian-image: wrote %s (layer %s MiB)\n' "$OUT" "$((LAYER_SIZE >> 20))"
