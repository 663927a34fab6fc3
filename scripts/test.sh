#!/usr/bin/env bash
# The whole test suite, on a fresh machine or an old one: bash scripts/test.sh [pytest args]
# Fails when no test ran (pytest's exit code 5).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# pytest-xdist workers (one test file each at a time) when it is installed, one more than the cores (at most 8):
# most of the suite's time is XLA compiling, one core a worker, and the extra worker compiles while another waits
# (for a subprocess, a file, a lock); on 2 cores, three left them idle 3% of a cold run. JODPO_TEST_WORKERS=N sets
# the number (1: one process). A worker that crashes (a segfault in native code) ends the run as a failure at once:
# xdist 3.8's replacement of a crashed loadfile worker was seen to hang until CI's time limit.
cores="$(nproc 2>/dev/null || echo 2)"
workers="${JODPO_TEST_WORKERS:-$(( cores + 1 < 8 ? cores + 1 : 8 ))}"
JODPO_EXTRAS=test bash "$root/scripts/env.sh" bash -c '
  if [ "$0" -gt 1 ] && python3 -c "import xdist" 2>/dev/null; then
    set -- -n "$0" --dist loadfile --max-worker-restart 0 "$@"
  fi
  exec python3 -m pytest "$@"' "$workers" "$root/tests" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "[jodpo] no tests ran: failing" >&2; exit 1; fi
exit "$rc"
