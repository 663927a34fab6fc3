"""``python -m jodpo.plot RUN_DIR [RUN_DIR ...] [--label NAME ...] [--out curves.png]``: a run's curves.

Reads each run's ``metrics.jsonl`` (a finished run or one still writing) and draws one panel per metric, the runs
overlaid with a legend: score, KL, loss, evaluation win rate, learning rate and throughput by default, each only if
some run logged it. Needs matplotlib (``pip install 'jodpo[plot]'``); draws off-screen (Agg), without pyplot.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence

# metric -> panel title
CURVES = {
    "objective/scores": "score (objective/scores)",
    "objective/kl": "KL (objective/kl)",
    "loss": "loss",
    "eval/win_rate": "eval win rate (eval/win_rate)",
    "learning_rate": "learning rate",
    "eps": "episodes per second (eps)",
}
INSTALL = "pip install 'jodpo[plot]' (or pip install matplotlib)"


class PlotError(ValueError):
    """Runs that cannot be plotted: the message names the run or the metric and the fix."""


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The lines of ``run_dir/metrics.jsonl`` (a run being written may end with a partial line: it is left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir} has no metrics.jsonl; give a training output_dir")
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i < len(lines) - 1:  # only the line being written may be partial
                raise PlotError(f"{path}: line {i + 1} is not JSON; the file is damaged") from None
            continue
        if "lr" in row and "learning_rate" not in row:  # a run written before jodpo took TRL's name
            row["learning_rate"] = row.pop("lr")
        out.append(row)
    return out


def series(lines: list[dict], metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``metric`` over the lines that logged it (finite values only)."""
    points = [(m["step"], m[metric]) for m in lines if isinstance(m.get(metric), (int, float))
              and math.isfinite(m[metric])]
    return [s for s, _ in points], [v for _, v in points]


def _labels(runs: Sequence[Path], labels: Sequence[str] | None) -> list[str]:
    if labels:
        if len(labels) != len(runs):
            raise PlotError(f"{len(labels)} labels for {len(runs)} runs; give one --label per run, in order")
        return list(labels)
    names = [Path(r).resolve().name for r in runs]
    return names if len(set(names)) == len(names) else [str(r) for r in runs]  # same names: the paths given


def figure(runs: Sequence[str | Path], labels: Sequence[str] | None = None, metrics: Sequence[str] = tuple(CURVES),
           title: str | None = None):
    """A matplotlib ``Figure`` of the ``metrics`` that the runs (training output directories) logged against ``step``:
    one panel per metric some run logged, the runs overlaid and named by ``labels`` (default: their directory
    names). Raises ``PlotError`` for a run without ``metrics.jsonl`` or no metric to draw, and
    ``ModuleNotFoundError`` (with the install command) without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ModuleNotFoundError(f"jodpo.plot needs matplotlib, which is not installed; {INSTALL}") from None
    names = _labels(runs, labels)
    data = {name: read_metrics(run) for name, run in zip(names, runs)}
    present = [m for m in metrics if any(series(lines, m)[0] for lines in data.values())]
    if not present:
        raise PlotError(f"none of the metrics {', '.join(metrics)} is logged in {', '.join(map(str, runs))}")
    cols = 3 if len(present) > 4 else min(2, len(present))
    rows = math.ceil(len(present) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.0 * rows), layout="constrained")  # no pyplot: no GUI, no global state
    axes = fig.subplots(rows, cols, squeeze=False).reshape(-1)
    every = [m["step"] for lines in data.values() for m in lines]
    pad = 0.03 * max(1, max(every) - min(every))
    span = (min(every) - pad, max(every) + pad)  # every panel spans all the steps (evaluations come sparse)
    for ax, metric in zip(axes, present):
        for i, (name, lines) in enumerate(data.items()):
            steps, values = series(lines, metric)
            if steps:  # a run keeps its colour in every panel; a sparse series (evaluations) gets markers
                ax.plot(steps, values, label=name, color=f"C{i % 10}", marker="o" if len(steps) <= 12 else None,
                        markersize=3)
        ax.set_xlim(*span)
        ax.set_title(CURVES.get(metric, metric), fontsize=10)
        ax.set_xlabel("step", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[len(present):]:
        ax.set_visible(False)
    if len(data) > 1:
        handles = [h for ax in axes for h in ax.get_lines()]
        first = {h.get_label(): h for h in reversed(handles)}  # one legend entry per run, in the runs' order
        shown = [n for n in names if n in first]
        _legend(fig, [first[n] for n in shown], shown)
    if title:
        fig.suptitle(title)
    return fig


def _legend(fig, handles, labels) -> None:
    """The runs' legend below the panels in as few rows as fit the figure's width, the rows balanced (six long
    labels: two rows of three, not five and one)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()

    def place(ncols: int):
        return fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=9)

    fit = len(labels)
    while fit > 1:
        trial = place(fit)
        wide = trial.get_window_extent(renderer).width > fig.bbox.width
        trial.remove()
        if not wide:
            break
        fit -= 1
    place(math.ceil(len(labels) / math.ceil(len(labels) / fit)))


def plot_runs(runs: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None,
              metrics: Sequence[str] = tuple(CURVES), title: str | None = None) -> Path:
    """``figure(runs, labels, metrics, title)`` written to the PNG ``out`` (its directory created); returns ``out``."""
    out = Path(out)
    fig = figure(runs, labels, metrics, title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jodpo.plot", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="training output directories (each with a metrics.jsonl)")
    parser.add_argument("--out", default="curves.png", help="the PNG to write (default: curves.png)")
    parser.add_argument("--label", action="append", help="a run's name in the legend, once per run, in order "
                                                         "(default: the directory names)")
    parser.add_argument("--metrics", help=f"comma-separated metrics to draw (default: {','.join(CURVES)})")
    parser.add_argument("--title", help="a title above the panels")
    args = parser.parse_args(argv)
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else list(CURVES)
    try:
        out = plot_runs(args.runs, args.out, args.label, metrics, args.title)
    except (PlotError, ModuleNotFoundError) as e:
        print(f"jodpo.plot: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
