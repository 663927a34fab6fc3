#!/usr/bin/env bash
# The whole test suite, on a fresh machine or an old one: bash scripts/test.sh [pytest args]
# Fails when no test ran (pytest's exit code 5).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Two pytest workers (pytest-xdist, one test file each at a time) when it is installed: most of the suite's time
# is XLA compiling, one core each. JODPO_TEST_WORKERS=1 runs it in one process. A worker that crashes (a segfault
# in native code) ends the run as a failure at once: xdist 3.8's replacement of a crashed loadfile worker was seen
# to hang until CI's time limit.
workers="${JODPO_TEST_WORKERS:-2}"
JODPO_EXTRAS=test bash "$root/scripts/env.sh" bash -c '
  if [ "$0" -gt 1 ] && python3 -c "import xdist" 2>/dev/null; then
    set -- -n "$0" --dist loadfile --max-worker-restart 0 "$@"
  fi
  exec python3 -m pytest "$@"' "$workers" "$root/tests" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "[jodpo] no tests ran: failing" >&2; exit 1; fi
exit "$rc"
