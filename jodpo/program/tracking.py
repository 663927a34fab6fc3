"""Experiment trackers named by ``report_to`` (TRL's / transformers' field): TensorBoard and Weights & Biases.

``metrics.jsonl`` is always written (``jodpo.program.metrics_log``); ``report_to`` adds the trackers. W&B sees a run as a TRL run
shows there (transformers' ``WandbCallback``): training metrics under ``train/NAME``, evaluation metrics under
``eval/NAME``, the x axis ``train/global_step`` (the ``step`` of ``metrics.jsonl``), the resolved config as the run's
config, and each table of sample completions as a ``completions`` table.
"""
from __future__ import annotations

import importlib
import os
from jodpo.errors import ConfigError
from pathlib import Path


TRACKERS = ("tensorboard", "wandb")
INSTALL = {"wandb": "pip install 'jodpo[wandb]' (or pip install wandb)"}
RUN_ID_FILE = "wandb_run_id"  # in output_dir: a resumed run continues the same W&B run


def _installed(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def trackers(report_to: str | tuple[str, ...]) -> tuple[str, ...]:
    """``report_to`` as the trackers it names: "none" -> (), "all" -> every installed one, a name or a list of
    names as they are. Unknown names, and a named tracker that is not installed, raise ``ConfigError``."""
    names = (report_to,) if isinstance(report_to, str) else tuple(report_to)
    if names in (("none",), ()):
        return ()
    if names == ("all",):
        return tuple(t for t in TRACKERS if t == "tensorboard" or _installed(t))
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"report_to: unknown tracker {unknown[0]!r}; use one of {', '.join(TRACKERS)} (or a list of "
                          "them), 'all' or 'none'")
    for n in names:
        if n in INSTALL and not _installed(n):
            raise ConfigError(f"report_to names {n!r}, which is not installed; {INSTALL[n]}, or drop it from report_to")
    return tuple(dict.fromkeys(names))


def wandb_name(key: str) -> str:
    """A ``metrics.jsonl`` key as TRL runs name it in W&B (transformers' ``rewrite_logs``)."""
    if key == "step":
        return "train/global_step"
    return key if key.startswith("eval/") else "train/" + key


class WandbTracker:
    """One W&B run for a training run, from process 0. Project: ``$WANDB_PROJECT`` (default ``huggingface``, as
    transformers); name: ``run_name`` (default W&B's); files: ``$WANDB_DIR`` (default ``output_dir``). The run's id
    is kept in ``output_dir/wandb_run_id``, so a resumed run (``start_step > 0``) continues the same W&B run;
    ``WANDB_RUN_ID``, ``WANDB_MODE=offline`` and the other W&B variables work as with any W&B run."""

    def __init__(self, output_dir: Path, config: dict, run_name: str | None, start_step: int):
        import wandb

        self.wandb = wandb
        id_file = output_dir / RUN_ID_FILE
        run_id = os.environ.get("WANDB_RUN_ID") or (id_file.read_text().strip() if start_step and id_file.exists()
                                                     else None)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "huggingface"), name=run_name, id=run_id,
                              resume="allow", config=config, dir=os.environ.get("WANDB_DIR", str(output_dir)))
        id_file.write_text(self.run.id + "\n")
        # every metric is plotted against the step of metrics.jsonl, also after a resume replays steps
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def log(self, record: dict) -> None:
        self.run.log({wandb_name(k): v for k, v in record.items()})

    def table(self, step: int, rows: list[tuple[str, str, float]], tag: str) -> None:
        table = self.wandb.Table(columns=["step", "prompt", "completion", "score"],
                                 data=[[step, p, c, s] for p, c, s in rows])
        self.run.log({tag: table, "train/global_step": step})

    def close(self) -> None:
        self.run.finish()
