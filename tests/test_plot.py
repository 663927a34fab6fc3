"""python -m jodpo.plot: a real run's curves (the tiny_run fixture's metrics.jsonl) to a PNG, several runs overlaid."""
import collections
import json
import subprocess
import sys

import numpy as np
import pytest

from jodpo import plot
from tests import subproc


@pytest.fixture
def two_runs(tiny_run, tmp_path):
    """tiny_run, and a second run that stopped half-way through writing a line at step 100 (its scores halved, as
    a distinguishable second curve, and a judge's eval/win_rate at its evaluations, which tiny_run has not)."""
    lines = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    other = tmp_path / "half"
    other.mkdir()
    rows = [m | {"objective/scores": m["objective/scores"] / 2} if "objective/scores" in m else
            m | {"eval/win_rate": 0.625} for m in lines if m["step"] <= 100]
    (other / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows) + '{"step": 110, "lo')
    return tiny_run, other, lines, rows


def test_figure_draws_each_metric_of_each_run(two_runs):
    full, half, lines, rows = two_runs
    fig = plot.figure([full, half], labels=["beta 0.1", "half"])
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert sorted(panels) == sorted(plot.CURVES.values())
    for metric, title in plot.CURVES.items():
        drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in panels[title].lines}
        expected = {"beta 0.1": plot.series(lines, metric), "half": plot.series(rows, metric)}
        assert drawn == {k: v for k, v in expected.items() if v[0]}, metric
    assert plot.series(rows, "eval/win_rate") == ([100], [0.625])
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["beta 0.1", "half"]
    # the tiny run alone logs no eval/win_rate (its eval data has no references): that panel is left out
    alone = plot.figure([full])
    assert "eval/win_rate" not in " ".join(ax.get_title() for ax in alone.axes if ax.get_visible())
    assert sum(ax.get_visible() for ax in alone.axes) == len(plot.CURVES) - 1 and not alone.legends


def _legend_rows(fig) -> list[int]:
    """How many entries each row of the figure's legend holds, from where its texts are drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    return sorted(collections.Counter(round(t.get_window_extent(renderer).y0) for t in fig.legends[0].get_texts())
                  .values())


def test_legend_of_many_long_labels_wraps_into_balanced_rows_within_the_figure(two_runs):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    full, half, _, _ = two_runs
    labels = [f"a long run name, seed {i}" for i in range(6)]
    fig = plot.figure([full, half] * 3, labels=labels, metrics=["objective/scores", "loss"])
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == labels
    assert legend.get_window_extent(FigureCanvasAgg(fig).get_renderer()).width <= fig.bbox.width
    assert _legend_rows(fig) in ([3, 3], [2, 2, 2])  # balanced, never 5 + 1
    assert _legend_rows(plot.figure([full, half], labels=["a", "b"])) == [2]  # short labels stay on one row


def test_plot_command_writes_a_png_of_several_runs(two_runs, tmp_path):
    from PIL import Image

    full, half, _, _ = two_runs
    out = tmp_path / "img" / "curves.png"
    proc = subprocess.run([sys.executable, "-m", "jodpo.plot", str(full), str(half), "--label", "full",
                           "--label", "half", "--out", str(out)], env=subproc.env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote {out}"
    with Image.open(out) as img:
        assert img.format == "PNG" and img.size == (1260, 600), img.size  # 3 x 2 panels of 4.2 x 3.0 in, 100 dpi
        pixels = np.asarray(img.convert("L"))
    assert (pixels < 128).mean() > 0.01  # curves, axes and text, not a blank page
    assert out.stat().st_size < 200_000


def _error(argv, capsys) -> str:
    assert plot.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_plot_errors_are_one_line(two_runs, tmp_path, monkeypatch, capsys):
    full, half, _, _ = two_runs
    assert "has no metrics.jsonl; give a training output_dir" in _error([str(tmp_path / "nothing")], capsys)
    assert "1 labels for 2 runs" in _error([str(full), str(half), "--label", "a"], capsys)
    assert "none of the metrics nope is logged" in _error([str(full), "--metrics", "nope"], capsys)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "metrics.jsonl").write_text('{"step": 1, "lo\n{"step": 2, "loss": 0.5}\n')
    assert "metrics.jsonl: line 1 is not JSON; the file is damaged" in _error([str(damaged)], capsys)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as without matplotlib
    assert "needs matplotlib, which is not installed; pip install 'jodpo[plot]'" in _error([str(full)], capsys)
