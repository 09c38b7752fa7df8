#!/usr/bin/env bash
# The whole test suite: sets the host up (idempotent), then runs every unit and
# end-to-end test. End-to-end test binaries each start their own server; cargo runs test
# binaries one after another, so at most one agentenv server owns the host's slots.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PATH="$HOME/.cargo/bin:$PATH"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
# The host lock keeps a concurrent bench or test run from owning the same slot names.
flock /run/agentenv-host.lock cargo test --release -- --test-threads=2
