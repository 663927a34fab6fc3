"""``push_to_hub``: the trained policy pushed to a Hub model repo with ``huggingface_hub``, from process 0, as
transformers' Trainer pushes (TRL's trainers are transformers'):

- the repo ``hub_model_id`` (default: ``output_dir``'s name) is created when the run starts (``exist_ok``;
  ``hub_private_repo``; ``hub_token``, else huggingface_hub's own token), so that a wrong token or name stops the run
  before it trains;
- at each save (``hub_strategy`` ``every_save``, ``checkpoint``, ``all_checkpoints``) the checkpoint's policy is
  exported as a transformers directory (a LoRA run's as a PEFT adapter directory, as TRL pushes it), with the
  tokenizer, and uploaded to the repo's root: "Training in progress, step N" (``save_strategy="epoch"``: "epoch E");
- ``checkpoint`` also uploads the resumable run (``config.json``, ``source_model/``, ``checkpoints/<step>/``) to
  ``last-checkpoint/`` (replacing what was there), ``all_checkpoints`` to ``checkpoint-<step>/``: downloaded, that
  folder is an ``output_dir`` a run resumes from (transformers pushes its checkpoint folder there likewise);
- ``hub_strategy="end"`` pushes nothing while training; the command pushes the policy when training ends ("End of
  training", as TRL's example scripts end with ``trainer.push_to_hub()``), a script when it calls
  ``save_model()`` ("Model save") or ``push_to_hub()``.

Each push completes before training goes on (transformers uploads in the background and may skip a push while one
is in flight); a failed push raises ``HubError``, the checkpoint already on disk.
"""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from jodpo.errors import HubError
from jodpo.program.trained_policy import export_run


def repo_name(cfg) -> str:
    """``hub_model_id``, or as transformers names it: ``output_dir``'s last part."""
    return cfg.hub_model_id or Path(cfg.output_dir).absolute().name


class Hub:
    """A run's Hub repo, created (or found) when made; ``token`` and ``private`` replace the config's."""

    def __init__(self, cfg, token: str | None = None, private: bool | None = None):
        from huggingface_hub import HfApi

        self.cfg = cfg
        self.api = HfApi(token=token if token is not None else cfg.hub_token)
        name = repo_name(cfg)
        self.repo_id = name
        with self._said(f"creating the repo {name!r}"):
            self.repo_id = self.api.create_repo(name, private=cfg.hub_private_repo if private is None else private,
                                                exist_ok=True).repo_id

    @contextlib.contextmanager
    def _said(self, what: str):
        """Whatever huggingface_hub raises (no network, a wrong token, a name taken) as one ``HubError`` line."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - huggingface_hub and the HTTP client raise many kinds
            first = (str(e).strip().splitlines() or [""])[0]
            raise HubError(f"push_to_hub: {what} at {self.api.endpoint} failed ({type(e).__name__}: {first}); "
                           f"check the network, hub_token (or $HF_TOKEN) and hub_model_id ({self.repo_id!r}); the "
                           "run's checkpoints are intact") from e

    def upload(self, folder: str | Path, message: str, path_in_repo: str | None = None, allow=None,
               replace: bool = False, revision: str | None = None):
        """``folder`` (the files ``allow`` matches, default all) into the repo at ``path_in_repo``; ``replace``:
        the files there before that are not uploaded again are deleted."""
        with self._said(f"pushing {folder} ({message!r})"):
            return self.api.upload_folder(repo_id=self.repo_id, folder_path=str(folder), path_in_repo=path_in_repo,
                                          commit_message=message, allow_patterns=allow,
                                          delete_patterns="*" if replace else None,
                                          revision=revision if revision is not None else self.cfg.hub_revision)

    def push_policy(self, run_dir: Path, message: str, step_dir: Path | None = None, params: dict | None = None,
                    revision: str | None = None):
        """The run's policy (``params`` on the host, else checkpoint ``step_dir``, else the newest) exported and
        uploaded to the repo's root; returns huggingface_hub's ``CommitInfo``."""
        with tempfile.TemporaryDirectory(dir=run_dir, prefix=".push-") as tmp:
            export_run(run_dir, Path(tmp) / "policy", step_dir, params)
            return self.upload(Path(tmp) / "policy", message, revision=revision)

    def push_save(self, run_dir: Path, step: int, epoch: float) -> None:
        """What ``hub_strategy`` pushes when checkpoint ``step`` has been saved."""
        message = (f"Training in progress, step {step}" if self.cfg.save_strategy == "steps" else
                   f"Training in progress, epoch {int(epoch)}")
        step_dir = run_dir / "checkpoints" / str(step)
        self.push_policy(run_dir, message, step_dir)
        if self.cfg.hub_strategy in ("checkpoint", "all_checkpoints"):
            where = "last-checkpoint" if self.cfg.hub_strategy == "checkpoint" else f"checkpoint-{step}"
            self.upload(run_dir, message + ", checkpoint", where, replace=self.cfg.hub_strategy == "checkpoint",
                        allow=["config.json", "source_model/*", f"checkpoints/{step}/*"])
