#!/usr/bin/env bash
# Makes the appliance bundle, one tarball with everything a host without Rust needs:
#   agentenv-<version>-x86_64-linux/
#     bin/agentenv               the static server binary (also the CLI)
#     assets/                    guest kernel, initramfs (with the agent), built-in base image
#     config/config.toml         the default config, every key commented
#     systemd/agentenv.service   the unit
#     doc/                       docs/*.md and the README
#     install.sh                 install, upgrade, --uninstall [--purge]
#
# usage: scripts/bundle.sh [--out DIR] [--binary PATH] [--assets DIR]
#   --out     where the tarball goes (default target/bundle)
#   --binary  a static server binary already built (default: build it, scripts/build-static.sh)
#   --assets  the guest assets (default $AENV_ASSETS_DIR or /var/lib/agentenv/assets, as
#             made by scripts/setup.sh from this tree)
# Prints the tarball's path on the last line.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$ROOT/target/bundle
BIN=
ASSETS=${AENV_ASSETS_DIR:-/var/lib/agentenv/assets}

die() { printf 'bundle: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift ;;
    --binary) BIN=$2; shift ;;
    --assets) ASSETS=$2; shift ;;
    *) die "unknown argument: $1" ;;
  esac
  shift
done

if [ -z "$BIN" ]; then
  "$ROOT/scripts/build-static.sh" >&2
  BIN=$ROOT/target/x86_64-unknown-linux-gnu/release/agentenv
fi
[ -x "$BIN" ] || die "no server binary at $BIN"
# The bundle is for hosts that may have another libc: refuse a dynamic binary.
ldd "$BIN" 2>&1 | grep -q 'statically linked\|not a dynamic' || die "$BIN is not statically linked (scripts/build-static.sh builds one)"
for f in initramfs.img base-image/index.json; do
  [ -e "$ASSETS/$f" ] || die "$ASSETS/$f missing: run scripts/setup.sh first"
done
KERNEL=vmlinux
[ -f "$ASSETS/$KERNEL" ] || KERNEL=vmlinuz
[ -f "$ASSETS/$KERNEL" ] || die "no guest kernel in $ASSETS: run scripts/setup.sh first"

VERSION=$("$BIN" --version | awk '{print $2}')
NAME=agentenv-$VERSION-x86_64-linux
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STAGE=$(mktemp -d "$OUT/.stage.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
D=$STAGE/$NAME
mkdir -p "$D/bin" "$D/assets" "$D/config" "$D/systemd" "$D/doc"
install -m 755 "$BIN" "$D/bin/agentenv"
cp "$ASSETS/$KERNEL" "$ASSETS/initramfs.img" "$D/assets/"
[ ! -f "$ASSETS/kernel-version" ] || cp "$ASSETS/kernel-version" "$D/assets/"
cp -R "$ASSETS/base-image" "$D/assets/base-image"
install -m 644 "$ROOT/config/default.toml" "$D/config/config.toml"
install -m 644 "$ROOT/packaging/agentenv.service" "$D/systemd/agentenv.service"
install -m 755 "$ROOT/packaging/install.sh" "$D/install.sh"
cp "$ROOT"/docs/*.md "$D/doc/"
cp "$ROOT/README.md" "$D/doc/README.md"
{
  echo "agentenv $VERSION"
  git -C "$ROOT" rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' || true
  [ ! -f "$ASSETS/kernel-version" ] || echo "guest kernel $(cat "$ASSETS/kernel-version")"
} > "$D/VERSION"

TARBALL=$OUT/$NAME.tar.gz
tar -C "$STAGE" --owner=0 --group=0 -czf "$TARBALL.tmp" "$NAME"
mv -f "$TARBALL.tmp" "$TARBALL"
printf 'bundle: %s (%s)\n' "$TARBALL" "$(du -h "$TARBALL" | cut -f1)" >&2
echo "$TARBALL"
