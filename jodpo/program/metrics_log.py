"""Run output: ``metrics.jsonl``, the trackers of ``report_to`` (TensorBoard by tensorboardX, Weights & Biases:
``jodpo.program.tracking``), a console progress bar, completion tables.

Only the main process writes (``enabled=False`` elsewhere). Metric names are TRL's plus ``loss``,
``grad_norm``, ``learning_rate``, ``episode``, ``step``, ``epoch`` and ``eps`` (prompts per second of wall time over the
logging interval, sampling, scoring and update included).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tqdm.auto import tqdm

from jodpo.program.tracking import WandbTracker, trackers


def truncate_metrics(path: Path, last_step: int) -> None:
    """Make ``metrics.jsonl`` what a run resumed from ``last_step`` appends to: each step's lines once, in step
    order, none after ``last_step`` (the resumed run logs them again). A line torn by a kill is dropped, and a line
    repeated (a step logged again by a run that crashed before its next save, or by two runs at once) is kept
    once, as last written; a step's training and evaluation lines are different lines. Rewritten aside and
    renamed, so a kill meanwhile leaves the old file."""
    if not path.exists():
        return
    records: dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) or record["step"] > last_step:
            continue
        key = (record["step"], tuple(sorted(record)))
        records[key] = record  # the last written, at the place of the first among its step's lines
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in sorted(records.values(), key=lambda r: r["step"])))
    tmp.replace(path)


class StepBar(tqdm):
    """The run's progress bar (tqdm's, or its notebook form), whose time left counts only the steady steps: a run's
    (or a resumed run's) first step compiles its programs, which a rate over the elapsed time would spread over every
    step to come (an ETA of 40 minutes for a run of one). Until a second step has ended it says ``?``; after it, the
    rate is that of the steps since the first ended."""

    def update(self, n=1):
        first = getattr(self, "_steady_from", None) is None
        out = super().update(n)
        if first:
            self._steady_from = (self.n, self._time())  # the end of the compiling step
        return out

    @property
    def format_dict(self):
        d = super().format_dict
        start = getattr(self, "_steady_from", None)
        if start is None or self.n <= start[0]:
            d["rate"] = 0.0  # tqdm then shows the time left as "?"
        else:
            d["rate"] = (self.n - start[0]) / max(self._time() - start[1], 1e-9)
        return d


class _Lines:
    """The progress bar's stream where stderr is not a terminal (a log file, a pipe, ``2>&1`` into one file with
    stdout): every redraw a line of its own, the blanking of a clear dropped. Redrawn in place there, the bar's
    carriage returns pile up in the file, and a line printed to stdout meanwhile lands after the bar's last text
    on the same line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def bar_options(every: float = 10.0) -> dict:
    """tqdm's options for a command's progress bar on stderr: redrawn in place on a terminal; elsewhere a line at the
    start, at most one every ``every`` seconds, and one at the end (``_Lines``)."""
    return {} if sys.stderr.isatty() else {"file": _Lines(sys.stderr), "mininterval": every}


def penalty_note(missing_eos_penalty: float | None, penalty_reward_value: float | None) -> str | None:
    """The line that says which numbers on screen carry an EOS penalty, when the run has one (else None)."""
    if missing_eos_penalty is None and penalty_reward_value is None:
        return None
    penalty = (f"minus missing_eos_penalty={missing_eos_penalty}" if missing_eos_penalty is not None else
               f"replaced by penalty_reward_value={penalty_reward_value}")
    return (f"the bar's score is objective/scores: the reward {penalty} for completions without EOS, as TRL logs it "
            "and pairs by; the completion tables and eval/objective/scores show the reward before that penalty")


def loading_note(cfg) -> str:
    """The line shown while a run reads its models and data (tens of seconds for a real model, with nothing else on
    the screen)."""
    parts = [f"the policy ({cfg.model_name_or_path})"]
    if cfg.reward_model_path:
        parts.append(f"the reward model ({cfg.reward_model_path})")
    if cfg.judge and ":" not in cfg.judge:
        parts.append(f"the judge ({cfg.judge})")
    data = cfg.dataset_name or ", ".join(cfg.dataset_mixer or {})
    return f"loading {', '.join(parts)} and the data ({data})"


def compile_note(step: int, cache_dir: str | None) -> str:
    """The line shown before a run's first step, which compiles the step's programs (a minute or more on a CPU)."""
    later = (f"later starts of this config read them from the compilation cache ({cache_dir})" if cache_dir else
             "the compilation cache is off (compilation_cache_dir=None), so every start compiles them")
    return (f"step {step} compiles the step's programs first (XLA: a minute or more on a CPU, the first time); "
            f"{later}")


def _gb(n: int) -> str:
    """Bytes as a person reads them (decimal units, as ``du -h --si`` and disk makers count)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.{2 if n < 100 * size else 0}f} {unit}"
    return f"{n} B"


def checkpoint_note(state_bytes: int, model_bytes: int, only_model: bool, saves: int, limit: int | None) -> str:
    """How much disk the run's checkpoints take: each one's size, and how many are kept (``saves`` ahead)."""
    each = model_bytes if only_model else state_bytes
    what = (", the parameters only (save_only_model)" if only_model else
            f" (the parameters and AdamW's two moments; save_only_model=True: {_gb(model_bytes)})")
    kept = f"the newest {limit} kept (save_total_limit)" if limit else "every one kept (save_total_limit=None)"
    return (f"checkpoints: {_gb(each)} each{what}; {saves} to save, {kept}: up to "
            f"{_gb(each * min(saves, limit or saves))} on disk")


class RunLogger:
    """``report_to`` and ``run_name`` are the config's fields; ``config`` is the resolved config the trackers record
    (W&B's run config). ``penalty``: ``penalty_note``'s line, shown once at the start, when the run's scores carry
    an EOS penalty (the tables' rewards do not: their header then says so)."""

    def __init__(self, output_dir: Path, total_steps: int, start_step: int, enabled: bool = True,
                 report_to: str | tuple[str, ...] = "tensorboard", run_name: str | None = None,
                 config: dict | None = None, penalty: str | None = None):
        self.enabled = enabled
        if not enabled:
            return
        self.reward_header = "reward before EOS penalty" if penalty else "score"
        names = trackers(report_to)
        truncate_metrics(output_dir / "metrics.jsonl", start_step)
        self.jsonl = open(output_dir / "metrics.jsonl", "a")
        self.tb = self.wandb = None
        if "tensorboard" in names:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(output_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        if "wandb" in names:
            self.wandb = WandbTracker(output_dir, config or {}, run_name, start_step)
        desc = (config or {}).get("method", "online_dpo").replace("_", " ")  # online dpo, nash md, xpo
        # on a terminal the bar is redrawn in place; elsewhere it is a line at each logged step (and at the start
        # and the end), and the messages are plain lines of stdout
        self.in_place = sys.stderr.isatty()
        lines = {} if self.in_place else {"file": _Lines(sys.stderr), "mininterval": math.inf, "leave": False}
        self.bar = StepBar(total=total_steps, initial=start_step, desc=desc, dynamic_ncols=True,
                           bar_format="{desc} {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}", **lines)
        if penalty:
            self.message(penalty)

    def log(self, metrics: dict) -> None:
        """One logged step: a JSON line, the trackers' scalars, and the progress bar's postfix."""
        if not self.enabled:
            return
        record = {k: (float(v) if not isinstance(v, int) else v) for k, v in metrics.items()}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and math.isfinite(v):
                    self.tb.add_scalar(k, v, record["step"])
        if self.wandb is not None:
            self.wandb.log(record)
        if "loss" in record:  # a training step (evaluation lines only go to the files)
            # the completions' scores (XPO's and Nash-MD's: the policy's), else (judged) Nash-MD's probability or the
            # implicit rewards' margin
            nash_md = "rewards/probabilities" in record
            keys = ("objective/scores", "objective/model_scores", "rewards/chosen" if nash_md else "",
                    "rewards/probabilities", "rewards/margins")
            score = next((record[k] for k in keys if k in record), float("nan"))
            self.bar.set_postfix_str(f"eps {record.get('eps', 0):.1f} | loss {record['loss']:.4f} | score {score:.3f}",
                                     refresh=False)
            self.logged = True

    def advance(self, steps: int = 1) -> None:
        if self.enabled:
            self.bar.update(steps)
            if not self.in_place and getattr(self, "logged", False):  # the line of a logged step, as it ends
                self._line()

    def message(self, text: str) -> None:
        if self.enabled:
            self._write(text)

    def _line(self) -> None:
        self.bar.refresh()
        self.logged, self.shown = False, self.bar.n

    def _write(self, text: str) -> None:
        """A message on stdout: on a terminal around the bar (cleared and redrawn), elsewhere a plain line."""
        if self.in_place:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def table(self, step: int, rows: list[tuple[str, str, float]], tag: str = "completions") -> None:
        """Sample completions as a console table, a TensorBoard markdown table and a W&B table (``tag``, the full
        texts; TRL's name is ``completions``)."""
        if not self.enabled or not rows:
            return
        def clip(s, n, tail=False):  # prompts keep their end, completions their start
            s = " ".join(str(s).split())
            return s if len(s) <= n else ("..." + s[-(n - 3):] if tail else s[:n - 3] + "...")

        lines = [f"step {step}: {tag}", f"{'prompt':40s} | {'completion':50s} | {self.reward_header}"]
        lines += [f"{clip(p, 40, True):40s} | {clip(c, 50):50s} | {s:.3f}" for p, c, s in rows]
        self._write("\n".join(lines))
        md = [f"| prompt | completion | {self.reward_header} |", "| --- | --- | --- |"]
        md += [f"| {clip(p, 200, True)} | {clip(c, 400)} | {s:.3f} |".replace("\n", " ") for p, c, s in rows]
        if self.tb is not None:
            self.tb.add_text(tag, "\n".join(md), step)
        if self.wandb is not None:
            self.wandb.table(step, rows, tag)

    def close(self) -> None:
        if self.enabled:
            if not self.in_place and getattr(self, "shown", None) != self.bar.n:  # where the run ended
                self._line()
            self.bar.close()
            self.jsonl.close()
            for tracker in (self.tb, self.wandb):
                if tracker is not None:
                    tracker.close()
