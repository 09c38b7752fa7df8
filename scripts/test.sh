#!/usr/bin/env bash
# The whole test suite: sets the host up (idempotent, cached after the first run), then runs
# every unit and end-to-end test binary through scripts/run-tests, which prints a table of
# where the time went and fails when anything is left on the host (docs/testing.md).
# Arguments go to scripts/run-tests (e.g. `scripts/test.sh e2e_soak` runs one binary).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/lib/as-root.sh"
export PATH="$HOME/.cargo/bin:$PATH"
setup_started=$(date +%s)
"$ROOT/scripts/setup.sh"
echo "test.sh: setup took $(( $(date +%s) - setup_started )) s"
cd "$ROOT"
# The host lock keeps a concurrent bench or test run from owning the same slot names.
exec flock /run/agentenv-host.lock python3 "$ROOT/scripts/run-tests" "$@"
