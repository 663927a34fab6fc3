"""report_to: which trackers a run writes besides metrics.jsonl, and the errors when one cannot be used. A training
run's W&B files are read back in tests/test_train.py (test_a_resumed_run_reads_no_policy_weights_of_its_own_dtype)."""
import json
import sys

import pytest

from jodpo.errors import ConfigError
from jodpo import train
from jodpo.program.config import TrainConfig, parse_override
from jodpo.program.metrics_log import RunLogger
from jodpo.program.tracking import trackers, wandb_name


def test_report_to_names_trackers():
    assert trackers("tensorboard") == ("tensorboard",) == trackers(TrainConfig().report_to)  # today's default
    assert trackers("none") == () == trackers(())
    assert trackers(["wandb", "tensorboard", "wandb"]) == ("wandb", "tensorboard")
    assert trackers("all") == ("tensorboard", "wandb")  # wandb is installed with the test extra
    with pytest.raises(ConfigError, match="report_to: unknown tracker 'mlflow'"):
        TrainConfig(report_to=("tensorboard", "mlflow"))
    # on the command line a list stays a list (a string field keeps other literals as text)
    assert parse_override("--config.report_to=['tensorboard','wandb']") == ("report_to", ("tensorboard", "wandb"))
    assert parse_override("--config.run_name=123") == ("run_name", "123")


def test_wandb_names_are_trls():
    """transformers' WandbCallback: train/ before training metrics, eval/ kept, the step as train/global_step."""
    assert [wandb_name(k) for k in ("loss", "objective/kl", "eval/win_rate", "step")] == \
        ["train/loss", "train/objective/kl", "eval/win_rate", "train/global_step"]


def test_report_to_none_writes_metrics_jsonl_only(tmp_path):
    logger = RunLogger(tmp_path, 2, 0, report_to="none")
    logger.log({"step": 1, "loss": 0.5})
    logger.table(1, [("a prompt", "a completion", 1.0)])
    logger.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == \
        [{"step": 1, "loss": 0.5}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_only_process_0_reports(tmp_path, monkeypatch):
    """Other processes (enabled=False) start no tracker and write nothing, W&B included."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = RunLogger(tmp_path, 2, 0, enabled=False, report_to=("tensorboard", "wandb"))
    logger.log({"step": 1, "loss": 0.5})
    logger.close()
    assert list(tmp_path.iterdir()) == []


def test_wandb_not_installed_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    config = tmp_path / "config.py"
    config.write_text("def get_config():\n    return {'model_name_or_path': 'some/model'}\n")
    out = tmp_path / "out"
    rc = train.main(["--config", str(config), f"--config.output_dir={out}", "--config.report_to=wandb"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "report_to names 'wandb', which is not installed; pip install" in err
    assert not out.exists()  # refused before anything was written
