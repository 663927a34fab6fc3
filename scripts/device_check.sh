#!/usr/bin/env bash
# The GPU check of a short lease (docs/gpu.md): the suite's tests that carry weight with the GPU as jax's default
# backend, then the step and the sampler at a ~1.7B shape in bf16, each phase under its own time limit (8 minutes
# in all), into DIR/device_check.json and DIR/device_check.md (the table for docs/gpu.md).
#
#   bash scripts/device_check.sh --wheels        here, where pip reaches the package index: the wheels the GPU image
#                                                lacks, into .whl/ (.gitignore'd; the device tool carries it)
#   bash scripts/device_check.sh [DIR] [FLAGS]   there: installs .whl/*.whl (no network) into /tmp/site, then
#                                                python3 benchmarks/bench.py device --out DIR FLAGS (DIR: $OUT, or
#                                                device-check); --dry-run is the CPU check the suite runs
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
# What the GPU image lacks of jodpo's dependencies and the references, and transformers at the CPU suite's version
# (the image's 5.17 predates the fixtures' newer families).
WHEELS="transformers==5.24.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 tensorboardX==2.6.5 trl==1.16.0 gguf==0.19.0"

if [ "${1:-}" = --wheels ]; then
  # shellcheck disable=SC2086
  exec "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl $WHEELS
fi

out="${OUT:-device-check}"
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then out="$1"; shift; fi
case " $* " in *" --dry-run "*) dry=1 ;; *) dry=0 ;; esac
if [ "$dry" = 0 ] && compgen -G ".whl/*.whl" > /dev/null; then  # the dry run uses the environment it is given
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_check: the carried wheels in .whl/ did not install" >&2; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# jodpo from this checkout (nothing is installed there); torch and jax share the GPU, so jax must not take 75% of it
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
exec timeout 480 "$py" benchmarks/bench.py device --out "$out" "$@"
