"""The benchmarks' command line, kept where it always was: runs ``benchmarks/bench.py`` with the same arguments
(every subcommand and flag: ``python scripts/bench.py --help``). The benchmarks live in ``benchmarks/``."""
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"

if __name__ == "__main__":
    # exec: the same process, run exactly as ``python benchmarks/bench.py ARGS`` (its folder first on sys.path)
    os.execv(sys.executable, [sys.executable, str(BENCH), *sys.argv[1:]])
