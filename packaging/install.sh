#!/bin/sh
# Installs (or upgrades, or removes) agentenv from an unpacked bundle. No Rust needed.
#
#   sudo ./install.sh                 install or upgrade, enable and (re)start the service
#   sudo ./install.sh --uninstall     remove everything but the state dir /var/lib/agentenv
#                                      (and an edited /etc/agentenv/config.toml)
#   sudo ./install.sh --uninstall --purge   ... and those and the account agentenv-vm
#   ./install.sh --root DIR           the same under DIR (no systemctl, no account, no host
#                                      checks): for tests and image builds
#   --no-start                        enable the service but do not (re)start it
# An installed copy of this script is /usr/local/share/agentenv/install.sh.
# What goes where: docs/operations.md §3.2 (in the bundle: doc/operations.md).
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=/
MODE=install
PURGE=0
START=1
VM_USER=agentenv-vm

die() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }
say() { printf '==> %s\n' "$*"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --root) [ $# -ge 2 ] || die "--root needs a directory"; ROOT=$2; shift ;;
    --root=*) ROOT=${1#--root=} ;;
    --uninstall) MODE=uninstall ;;
    --purge) PURGE=1 ;;
    --no-start) START=0 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
  shift
done
[ "$PURGE" = 0 ] || [ "$MODE" = uninstall ] || die "--purge goes with --uninstall"
case "$ROOT" in /*) ;; *) die "--root needs an absolute path" ;; esac
ROOT=${ROOT%/}
SYSTEM=0
[ -n "$ROOT" ] || SYSTEM=1

BIN=$ROOT/usr/local/bin/agentenv
SHARE=$ROOT/usr/local/share/agentenv
UNIT=$ROOT/etc/systemd/system/agentenv.service
ETC=$ROOT/etc/agentenv
STATE=$ROOT/var/lib/agentenv
ASSETS=$STATE/assets

# systemctl only on the real root with systemd running (not in containers or image builds).
have_systemd() { [ "$SYSTEM" = 1 ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null; }

# The account QEMU runs as. scripts/setup.sh makes it with the same call.
ensure_vm_user() {
  getent passwd "$VM_USER" >/dev/null \
    || useradd --system --user-group --no-create-home --home-dir /nonexistent \
         --shell /usr/sbin/nologin "$VM_USER" || return
  # Each QEMU runs as a uid of its own from this range (docs/security.md).
  grep -qs "^$VM_USER:" /etc/subuid && return
  first=$(awk -F: 'BEGIN { m = 100000 } $2 + $3 > m { m = $2 + $3 } END { print m }' /etc/subuid 2>/dev/null)
  first=${first:-100000}
  usermod --add-subuids "$first-$((first + 65535))" "$VM_USER" \
    || die "cannot reserve subordinate uids for $VM_USER"
}

check_host() {
  major=$(qemu-system-x86_64 --version 2>/dev/null \
    | sed -n 's/^QEMU emulator version \([0-9]*\).*/\1/p')
  [ -n "$major" ] || die "qemu-system-x86_64 not found: install QEMU >= 10 (Debian 12: bookworm-backports)"
  [ "$major" -ge 10 ] || die "QEMU $major found, agentenv needs >= 10 (Debian 12: bookworm-backports)"
  command -v nft >/dev/null || die "nft not found: install nftables"
  command -v mkfs.ext4 >/dev/null || die "mkfs.ext4 not found: install e2fsprogs"
  command -v qemu-img >/dev/null || die "qemu-img not found: install qemu-utils"
}

# Copies $1 to $2 through a temporary name and a rename, so a running server never sees a
# half-written binary.
put() {
  mkdir -p "$(dirname "$2")"
  cp "$1" "$2.new"
  chmod "$3" "$2.new"
  mv -f "$2.new" "$2"
}

install_all() {
  [ -x "$HERE/bin/agentenv" ] || die "$HERE/bin/agentenv missing: run install.sh from an unpacked bundle"
  if [ "$SYSTEM" = 1 ]; then
    [ "$(id -u)" = 0 ] || die "run as root (or use --root DIR)"
    check_host
    ensure_vm_user
  fi
  say "binary: $BIN ($("$HERE/bin/agentenv" --version))"
  put "$HERE/bin/agentenv" "$BIN" 755

  say "guest assets: $ASSETS"
  [ -d "$STATE" ] || { mkdir -p "$STATE"; chmod 700 "$STATE"; }
  rm -rf "$ASSETS.new" "$ASSETS.old"
  cp -R "$HERE/assets" "$ASSETS.new"
  # Swap whole directories: kernel, initramfs (with its agent) and base image stay a set.
  [ ! -d "$ASSETS" ] || mv "$ASSETS" "$ASSETS.old"
  mv "$ASSETS.new" "$ASSETS"
  rm -rf "$ASSETS.old"

  mkdir -p "$ETC"
  put "$HERE/config/config.toml" "$ETC/config.toml.default" 644
  if [ -e "$ETC/config.toml" ]; then
    say "config: $ETC/config.toml kept (the shipped defaults are in config.toml.default)"
  else
    put "$HERE/config/config.toml" "$ETC/config.toml" 644
    say "config: $ETC/config.toml written (every key at its default)"
  fi

  # Docs, and this script for a later --uninstall without the bundle.
  mkdir -p "$SHARE/doc"
  cp "$HERE"/doc/*.md "$SHARE/doc/"
  put "$HERE/install.sh" "$SHARE/install.sh" 755
  put "$HERE/systemd/agentenv.service" "$UNIT" 644
  say "systemd unit: $UNIT"

  if have_systemd; then
    systemctl daemon-reload
    systemctl enable agentenv.service >/dev/null
    if [ "$START" = 1 ]; then
      # An upgrade restarts a running server: its shutdown pauses the sandboxes, the new
      # binary restores them on demand.
      systemctl restart agentenv.service
      say "service enabled and (re)started: systemctl status agentenv"
    else
      say "service enabled, not started: systemctl start agentenv"
    fi
  elif [ "$SYSTEM" = 1 ]; then
    say "systemd is not running here: start the server with $BIN serve --config /etc/agentenv/config.toml"
  else
    say "root $ROOT: no account, no systemctl (the unit is in place, not enabled)"
  fi
  say "API key: $(key_file) (generated on the server's first start; read it as root)"
}

# The API key file the server uses unless the config or AENV_API_KEY sets a key.
key_file() {
  dir=$(sed -n 's/^[[:space:]]*state_dir[[:space:]]*=[[:space:]]*"\(.*\)".*/\1/p' \
    "$ETC/config.toml" 2>/dev/null | head -n 1)
  printf '%s/api-key' "${dir:-/var/lib/agentenv}"
}

uninstall_all() {
  if [ "$SYSTEM" = 1 ]; then
    [ "$(id -u)" = 0 ] || die "run as root (or use --root DIR)"
  fi
  if have_systemd && [ -e "$UNIT" ]; then
    # Stopping pauses the running sandboxes into the state dir.
    systemctl disable --now agentenv.service >/dev/null 2>&1 || true
  fi
  rm -f "$UNIT" "$BIN"
  rm -rf "$SHARE" "$ASSETS" "$ASSETS.new" "$ASSETS.old"
  if have_systemd; then systemctl daemon-reload; fi
  # An untouched config goes; one the operator edited stays unless --purge.
  if [ -e "$ETC/config.toml.default" ] && cmp -s "$ETC/config.toml" "$ETC/config.toml.default"; then
    rm -f "$ETC/config.toml"
  fi
  rm -f "$ETC/config.toml.default"
  if [ "$PURGE" = 1 ]; then
    rm -rf "$ETC"
    # The state dir may be a mount point of its own: then its content goes, the dir stays.
    rm -rf "$STATE" 2>/dev/null || [ -z "$(ls -A "$STATE")" ] || die "cannot remove $STATE"
    if [ "$SYSTEM" = 1 ] && getent passwd "$VM_USER" >/dev/null; then
      userdel "$VM_USER" || true
    fi
    say "removed agentenv, its config, its state dir and the account $VM_USER"
  else
    rmdir "$ETC" 2>/dev/null || true
    say "removed agentenv; kept $STATE (sandboxes, snapshots, templates, api-key)"
    [ ! -e "$ETC/config.toml" ] || say "kept $ETC/config.toml (edited by you)"
    say "remove them too with: install.sh --uninstall --purge"
  fi
}

case "$MODE" in
  install) install_all ;;
  uninstall) uninstall_all ;;
esac
