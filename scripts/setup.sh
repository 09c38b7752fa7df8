#!/usr/bin/env bash
# Sets up a Debian 12 (bookworm) host for agentenv. Idempotent; run as root.
#  1. apt packages: QEMU >= 10 from bookworm-backports (the source is added when missing),
#     nftables, e2fsprogs, busybox-static, bash-static, cpio, lz4
#  2. the guest kernel from Debian's linux-image-cloud-amd64, unpacked into the assets dir
#     (never installed as the host's kernel)
#  3. the release server binary, and the static binaries (server for the bundle, in-guest
#     agent), plus the unprivileged account QEMU runs as (agentenv-vm)
#  4. the guest initramfs (agent as /init + virtio modules)
#  5. the built-in base image (busybox + static bash) as an OCI layout
#  6. the Debian 12 test image (debootstrap, cached in $AENV_TEST_IMAGES_DIR)
# Assets go to $AENV_ASSETS_DIR (default /var/lib/agentenv/assets, the config default).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/lib/as-root.sh"
export PATH="$HOME/.cargo/bin:$PATH"
ASSETS=${AENV_ASSETS_DIR:-/var/lib/agentenv/assets}
AGENT_TARGET=x86_64-unknown-linux-gnu
# Test tools: a python venv and an npm prefix (shared with the other test tools).
TEST_TOOLS=/opt/agentenv-tests
E2B_PY_VERSION=2.63.0
E2B_CODE_INTERPRETER_VERSION=2.11.5
SCHEMATHESIS_VERSION=4.32.5
E2B_JS_VERSION=2.51.0
PLAYWRIGHT_CORE_VERSION=1.65.1
PUPPETEER_CORE_VERSION=24.43.1
KUBERNETES_VALIDATE_VERSION=1.37.0

step() { printf '==> %s\n' "$*"; }
die() { printf 'setup: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (it installs packages and writes $ASSETS)"
command -v cargo >/dev/null || die "cargo not found: install a Rust toolchain (rustup) first"

qemu_major() {
  qemu-system-x86_64 --version 2>/dev/null | sed -n 's/^QEMU emulator version \([0-9]*\).*/\1/p'
}

step "apt packages"
export DEBIAN_FRONTEND=noninteractive
if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  step "adding the bookworm-backports apt source"
  cat > /etc/apt/sources.list.d/agentenv-backports.sources <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi
need=()
for pkg in nftables e2fsprogs busybox-static bash-static cpio lz4 iproute2 qemu-utils docker-registry skopeo apache2-utils systemd debootstrap nfs-ganesha nfs-ganesha-vfs; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || need+=("$pkg")
done
major=$(qemu_major || true)
if [ "${#need[@]}" -gt 0 ] || [ -z "$major" ] || [ "$major" -lt 10 ]; then
  apt-get update -qq || die "apt-get update failed"
fi
if [ -z "$major" ] || [ "$major" -lt 10 ]; then
  apt-get install -y -qq -t bookworm-backports --no-install-recommends qemu-system-x86 \
    || die "cannot install qemu-system-x86 from bookworm-backports"
fi
if [ "${#need[@]}" -gt 0 ]; then
  apt-get install -y -qq --no-install-recommends "${need[@]}" || die "cannot install ${need[*]}"
fi
step "QEMU: $(qemu-system-x86_64 --version | head -1)"

step "VM account agentenv-vm"
# Reserved for running QEMU unprivileged (docs/security.md); install.sh creates it alike.
getent passwd agentenv-vm >/dev/null \
  || useradd --system --user-group --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin agentenv-vm \
  || die "cannot create the system account agentenv-vm"
# Each QEMU runs as a uid of its own from the account's subordinate uid range
# (docs/security.md); install.sh reserves it alike.
if ! grep -qs '^agentenv-vm:' /etc/subuid; then
  first=$(awk -F: 'BEGIN { m = 100000 } $2 + $3 > m { m = $2 + $3 } END { print m }' /etc/subuid 2>/dev/null)
  first=${first:-100000}
  usermod --add-subuids "$first-$((first + 65535))" agentenv-vm \
    || die "cannot reserve subordinate uids for agentenv-vm"
fi

step "guest kernel into $ASSETS"
# The state dir holds guest disks and memory: private (the server tightens it too).
STATE=${AENV_STATE_DIR:-/var/lib/agentenv}
install -d -m 0700 "$STATE" && chmod 0700 "$STATE"
mkdir -p "$ASSETS"
"$ROOT/scripts/fetch-kernel.sh" "$ASSETS"

step "building the server (release)"
(cd "$ROOT" && cargo build --release --bin agentenv)

step "building the static server and guest agent"
"$ROOT/scripts/build-static.sh"
AGENT="$ROOT/target/$AGENT_TARGET/release/agentenv-agent"
[ -x "$AGENT" ] || die "agent binary missing at $AGENT"

step "guest initramfs"
"$ROOT/scripts/build-initramfs.sh" "$AGENT" "$ASSETS/modules" "$ASSETS/initramfs.img.tmp"
mv -f "$ASSETS/initramfs.img.tmp" "$ASSETS/initramfs.img"
rm -f "$ASSETS/initramfs.cpio"  # the uncompressed archive of earlier versions

step "built-in base image"
rm -rf "$ASSETS/base-image.tmp"
"$ROOT/target/release/agentenv" build-base-image --out "$ASSETS/base-image.tmp" --busybox /bin/busybox \
  --bash /bin/bash-static
rm -rf "$ASSETS/base-image"
mv "$ASSETS/base-image.tmp" "$ASSETS/base-image"

step "Debian 12 test image (debootstrap; cached after the first run)"
"$ROOT/scripts/build-debian-image.sh" || die "cannot build the Debian 12 test image"

step "E2B SDKs for the tests (python e2b $E2B_PY_VERSION, npm e2b $E2B_JS_VERSION)"
# Pinned; tests/e2e_sdk.rs drives them against the real server (docs/e2b.md). The JS SDK
# needs Node >= 20.18 (Debian 12 ships 18: take a newer nodejs where one is available).
sdk_need=()
dpkg-query -W -f='${Status}' python3-venv 2>/dev/null | grep -q 'install ok installed' || sdk_need+=(python3 python3-venv)
command -v node >/dev/null && command -v npm >/dev/null || sdk_need+=(nodejs npm)
if [ "${#sdk_need[@]}" -gt 0 ]; then
  apt-get update -qq || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends "${sdk_need[@]}" || die "cannot install ${sdk_need[*]}"
fi
mkdir -p "$TEST_TOOLS"
[ -x "$TEST_TOOLS/venv/bin/python" ] || /usr/bin/python3 -m venv "$TEST_TOOLS/venv" \
  || die "cannot create the venv $TEST_TOOLS/venv"
"$TEST_TOOLS/venv/bin/pip" install -q --disable-pip-version-check "e2b==$E2B_PY_VERSION" \
  || die "cannot install e2b==$E2B_PY_VERSION from PyPI"
# tests/e2e_ports.rs drives the code interpreter SDK (e2b pinned so pip keeps it).
"$TEST_TOOLS/venv/bin/pip" install -q --disable-pip-version-check "e2b==$E2B_PY_VERSION" \
  "e2b-code-interpreter==$E2B_CODE_INTERPRETER_VERSION" \
  || die "cannot install e2b-code-interpreter==$E2B_CODE_INTERPRETER_VERSION from PyPI"
# tests/e2e_fuzz.rs fuzzes the API from its OpenAPI document.
"$TEST_TOOLS/venv/bin/pip" install -q --disable-pip-version-check "schemathesis==$SCHEMATHESIS_VERSION" \
  || die "cannot install schemathesis==$SCHEMATHESIS_VERSION from PyPI"
# tests/deploy.rs validates deploy/kubernetes offline against the Kubernetes schemas it ships.
"$TEST_TOOLS/venv/bin/pip" install -q --disable-pip-version-check \
  "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" \
  || die "cannot install kubernetes-validate==$KUBERNETES_VALIDATE_VERSION from PyPI"
mkdir -p "$TEST_TOOLS/node"
(cd "$TEST_TOOLS/node" && npm install --silent --no-audit --no-fund --no-save "e2b@$E2B_JS_VERSION") \
  || die "cannot install e2b@$E2B_JS_VERSION from npm"

step "browser tests: Debian's chromium and firefox-esr, playwright-core $PLAYWRIGHT_CORE_VERSION and puppeteer-core $PUPPETEER_CORE_VERSION from npm"
# tests/e2e_console.rs drives the web console in headless Chromium and Firefox. Neither
# driver downloads a browser (never `npx playwright install`): playwright-core launches
# /usr/bin/chromium; puppeteer-core launches /usr/bin/firefox-esr over WebDriver BiDi
# (stock Firefox has no Juggler, and playwright-core's BiDi Firefox needs commands newer
# than ESR's). puppeteer-core 24 is the last line that supports Node 20.
browsers_need=()
command -v chromium >/dev/null || browsers_need+=(chromium)
command -v firefox-esr >/dev/null || browsers_need+=(firefox-esr)
if [ "${#browsers_need[@]}" -gt 0 ]; then
  apt-get update -qq || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends "${browsers_need[@]}" fonts-dejavu-core \
    || die "cannot install ${browsers_need[*]}"
fi
mkdir -p "$TEST_TOOLS/playwright" "$TEST_TOOLS/puppeteer"
(cd "$TEST_TOOLS/playwright" && npm install --silent --no-audit --no-fund --no-save \
  "playwright-core@$PLAYWRIGHT_CORE_VERSION") || die "cannot install playwright-core@$PLAYWRIGHT_CORE_VERSION from npm"
(cd "$TEST_TOOLS/puppeteer" && npm install --silent --no-audit --no-fund --no-save \
  "puppeteer-core@$PUPPETEER_CORE_VERSION") || die "cannot install puppeteer-core@$PUPPETEER_CORE_VERSION from npm"

step "domain-mode tests: Debian's nginx and dnsmasq"
# tests/e2e_domain.rs runs deploy/nginx/agentenv.conf in nginx (its own nginx.conf, its
# own process) and dnsmasq on loopback addresses; the distribution's services stay off.
if ! command -v nginx >/dev/null || ! command -v dnsmasq >/dev/null; then
  apt-get update -qq || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends nginx dnsmasq-base || die "cannot install nginx and dnsmasq-base"
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    systemctl disable --now nginx >/dev/null 2>&1 || true
  fi
fi

step "cluster tests: Debian's haproxy"
# tests/e2e_cluster.rs runs deploy/haproxy/haproxy.cfg in front of three nodes (its own
# process, in a test network namespace); the distribution's service stays off.
if ! command -v haproxy >/dev/null; then
  apt-get update -qq || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends haproxy || die "cannot install haproxy"
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    systemctl disable --now haproxy >/dev/null 2>&1 || true
  fi
fi

step "standby tests: Debian's tcpdump"
# tests/e2e_standby.rs captures on a warming standby's tap and slot veth: nothing leaves.
if ! command -v tcpdump >/dev/null; then
  apt-get update -qq || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends tcpdump || die "cannot install tcpdump"
fi

step "done: assets in $ASSETS"
ls -la "$ASSETS"
cat <<MSG

Start the server on the embedded defaults:
  $ROOT/scripts/serve
Create a sandbox from the built-in base image:
  curl -s -X POST http://127.0.0.1:8000/sandboxes-cold -H "X-API-Key: \$(sudo cat /var/lib/agentenv/api-key)" \\
       -H 'Content-Type: application/json' -d '{"image": "oci:$ASSETS/base-image"}'
MSG
