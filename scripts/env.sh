#!/usr/bin/env bash
# Run a command inside jodpo's virtual environment, creating and installing it first when needed.
#   bash scripts/env.sh python -m jodpo.train --config tiny.py
# JODPO_EXTRAS=test also installs the test references (pytest, torch CPU, trl); JODPO_EXTRAS=torch the CPU build of
# torch alone, for scripts that build transformers model objects (AutoModelForCausalLM...) and hand them to jodpo.
# Several extras: JODPO_EXTRAS=torch,plot.
# JODPO_NO_INSTALL=1 runs the command in the current environment instead (nothing created or installed).
set -euo pipefail
# The command runs where it was called from (relative paths are the caller's: output_dir, datasets, config files,
# reward modules); only the environment is the repository's.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${JODPO_NO_INSTALL:-}" = 1 ]; then
  # Use the Python environment already on PATH as it is (e.g. a GPU machine whose jax has CUDA; docs/gpu.md).
  exec "$@"
fi
venv="${JODPO_VENV:-$root/.venv}"
extras="${JODPO_EXTRAS:-}"
py="${PYTHON:-python3}"
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "jodpo needs Python >= 3.11 (set PYTHON=...)" >&2; exit 1; }
stamp="$venv/.jodpo-installed${extras:+-$extras}"
installed() { [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ ! "$root/pyproject.toml" -nt "$stamp" ]; }
# pip installs without compiling every module to bytecode (--no-compile: ~80 s of the test install, mostly torch's
# and transformers' modules that nothing here imports); Python writes the bytecode of what is imported, the first
# time it is imported, under the environment's own pycache directory, and reads it from there afterwards (also
# where PYTHONDONTWRITEBYTECODE is set, which would otherwise compile every import of every process anew).
if ! installed; then
  # One install at a time: the processes of a local multi-process job start their commands together, and two pips
  # writing one environment break each other's files. The others wait on the lock (a file beside the environment,
  # released when its holder ends, however it ends), then find it installed.
  mkdir -p "$(dirname "$venv")"
  exec 9>"$venv.lock"
  "$py" -c 'import fcntl; fcntl.flock(9, fcntl.LOCK_EX)'  # held by this shell's descriptor 9 until it closes
  if ! installed; then
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    echo "[jodpo] installing into $venv (once)" >&2
    "$venv/bin/python" -m pip install -q --no-compile --upgrade pip
    case ",$extras," in
      *,test,*|*,torch,*)
        # The CPU build of torch, before anything that depends on torch can pull the multi-GB CUDA wheels.
        "$venv/bin/python" -m pip install -q --no-compile "torch==2.13.0" ;;
    esac
    "$venv/bin/python" -m pip install -q --no-compile -e "$root${extras:+[$extras]}"
    touch "$stamp"
  fi
  exec 9>&-
fi
unset PYTHONDONTWRITEBYTECODE
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" PYTHONPYCACHEPREFIX="$venv/pycache"
exec "$@"
