#!/usr/bin/env bash
# Regenerates tests/golden/trl112_*.json: TRL 1.12's Nash-MD and XPO, recorded in environments of their own (TRL 1.12
# cannot share the suite's, which has TRL 1.16). Makes two virtualenvs once: $TRL112_VENV (default /tmp/trl112:
# torch 2.13, the CPU build; transformers 5.24, the suite's; trl 1.12.0) records everything; $TRL112_TF4_VENV
# (default /tmp/trl112tf4: transformers 4.57) records TRL's GeometricMixtureWrapper.generate under transformers 4 too
# (under both it parts from the greedy mixture of the wrapper's own forward: docs/online_family.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export TRL_EXPERIMENTAL_SILENCE=1

venv_with() {  # venv_with DIR TRANSFORMERS_SPEC
  if [ ! -x "$1/bin/python" ] || ! "$1/bin/python" -c "import trl; assert trl.__version__ == '1.12.0'" 2>/dev/null; then
    python3 -m venv "$1"
    "$1/bin/pip" install -q torch==2.13.0 trl==1.12.0 "$2" datasets accelerate safetensors requests
  fi
}

venv="${TRL112_VENV:-/tmp/trl112}"
tf4="${TRL112_TF4_VENV:-/tmp/trl112tf4}"
models="$(mktemp -d)"
trap 'rm -rf "$models"' EXIT
venv_with "$venv" "transformers==5.24.0"
venv_with "$tf4" "transformers>=4.56.2,<5"
cd "$root"
PYTHONPATH="$root" "$venv/bin/python" scripts/record_trl112.py --keep-models "$models" "$@"
PYTHONPATH="$root" "$tf4/bin/python" scripts/record_trl112_generate.py "$models"
