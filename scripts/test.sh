#!/usr/bin/env bash
# The whole test suite, on a fresh machine or an old one: bash scripts/test.sh [pytest args]
# Fails when no test ran (pytest's exit code 5).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JODPO_EXTRAS=test bash "$root/scripts/env.sh" python3 -m pytest "$root/tests" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "[jodpo] no tests ran: failing" >&2; exit 1; fi
exit "$rc"
