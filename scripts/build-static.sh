#!/usr/bin/env bash
# Builds the static binaries: the server `agentenv` (what the bundle ships) and the in-guest
# agent `agentenv-agent` (what the initramfs runs as /init), into
# target/x86_64-unknown-linux-gnu/release/. Static glibc (`crt-static` on the gnu target)
# needs no extra toolchain; both binaries share one compile of the library.
# Name resolution in the static server: docs/operations.md §3.3.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PATH="$HOME/.cargo/bin:$PATH"
cd "$ROOT"
RUSTFLAGS='-C target-feature=+crt-static' \
  cargo build --release --bins --target x86_64-unknown-linux-gnu
