"""Datasets: loading (hub or local files), chat templates, tokenization, bucketed batches, resumable order.

A prompt dataset has a ``prompt`` column (text, or chat messages rendered with the policy tokenizer's chat
template and ``add_generation_prompt=True``); any other columns reach callable rewards, and a ``completion``
column (TL;DR's reference summaries) gives ``eval/win_rate``. A dataset with ``chosen`` and ``rejected``
columns is preference data and selects offline DPO.

The order is a pure function of (seed, step): step ``k`` takes batch ``k % steps_per_epoch`` of the
permutation of epoch ``k // steps_per_epoch``, so a resumed run sees exactly the prompts it would have seen.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from jodpo.errors import CheckpointError, ConfigError, DataError
from jodpo.sampling import bucket_length

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}



def load_rows(name: str, config: str | None = None, split: str = "train"):
    """A ``datasets.Dataset`` from a hub id, a local file (json, jsonl, parquet, csv) or a local directory."""
    import datasets

    if not name:
        raise DataError("no dataset given: set dataset_name (a hub id or a local file or directory)")
    path = Path(name).expanduser()
    try:
        if path.is_file():
            kind = LOCAL_FORMATS.get(path.suffix)
            if kind is None:
                raise DataError(f"{path}: unknown file type {path.suffix!r}; use one of {sorted(LOCAL_FORMATS)}")
            if path.stat().st_size == 0:
                raise DataError(f"the dataset {path} is empty (0 bytes); give a file with rows")
            with _quiet(datasets):
                return datasets.load_dataset(kind, data_files={split: str(path)}, split=split)
        if path.is_dir():
            with _quiet(datasets):
                return datasets.load_dataset(str(path), config, split=split)
        if looks_local(name):  # never asked of the Hub: a file the user meant, missing
            raise DataError(f"dataset {name!r}: no such file or directory (looked at {path.resolve()}); give an "
                            "existing local file or directory (relative paths are taken from the current directory), "
                            "or a hub id like 'org/name'")
        return datasets.load_dataset(name, config, split=split)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the caller gets one DataError
        raise _load_error(name, path, e) from e


def _load_error(name: str, path: Path, e: Exception) -> DataError:
    """What went wrong loading ``name``, said once: a local JSON file's first bad line (not datasets' parser
    message), an unknown split, a dataset not found, anything else."""
    if path.is_file() and path.suffix in (".json", ".jsonl"):
        bad = json_line_error(path)
        if bad is not None:
            return DataError(bad)
    if isinstance(e, ValueError):  # an unknown split
        return DataError(f"dataset {name!r}: {e}")
    if isinstance(e, (FileNotFoundError, ConnectionError, OSError)):
        offline = " (the Hugging Face Hub is offline here: HF_HUB_OFFLINE is set or there is no network)" \
            if not path.exists() else ""
        return DataError(f"dataset {name!r} not found{offline}: give a local file or directory, or a hub id that is "
                         f"cached. ({type(e).__name__}: {e})")
    return DataError(f"dataset {name!r} could not be loaded: {type(e).__name__}: {e}")  # DatasetNotFoundError, ...


@contextlib.contextmanager
def _quiet(datasets):
    """No "Generating train split" bars for a local file (read in a moment; the run's own bar follows), and none of
    datasets' log lines: a file that does not parse is said once, by ``load_rows`` (datasets logs its parser's
    error twice, once through its own handler and once through the root logger, before raising it again)."""
    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    log = logging.getLogger("datasets")
    level = log.level
    log.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        log.setLevel(level)
        if was:
            datasets.enable_progress_bars()


def json_line_error(path: Path) -> str | None:
    """The first line of a JSON Lines file (datasets reads ``.json`` files as a JSON document or as JSON Lines) that
    is not a JSON object, said with its 1-based line number and the fix; None when the file parses (the problem is
    elsewhere)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        json.loads(text)
        return None  # one JSON document
    except json.JSONDecodeError:
        pass
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return (f"{path}, line {number}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno}); each line of a JSON Lines "
                    "file is one JSON object: fix or delete that line")
        if not isinstance(row, dict):
            return (f"{path}, line {number}: a JSON {type(row).__name__}, not an object; each line of a JSON Lines "
                    "file is one object of columns ({\"prompt\": ...}): fix or delete that line")
    return None


def looks_local(name: str) -> bool:
    """A dataset name that can only be a local path: a file suffix jodpo reads, or a path that starts at the root, the
    home or the current directory (a hub id is 'org/name')."""
    return Path(name).suffix in LOCAL_FORMATS or name.startswith(("/", "./", "../", "~")) or name.count("/") > 1


def load_mixture(mixer: dict, config: str | None = None, split: str = "train"):
    """open-instruct's ``dataset_mixer``: ``{dataset: amount}``, an amount above 1 a row count, else a fraction of
    the dataset; each dataset's first rows (in its stored order, as open-instruct without shuffling) concatenated in
    the mixer's order. Only the columns every dataset has are kept (they must line up to be concatenated)."""
    import datasets

    if not mixer:
        raise DataError("dataset_mixer is empty: give {dataset: fraction or row count, ...}")
    parts = []
    for name, amount in mixer.items():
        rows = load_rows(name, config, split)
        n = int(amount) if amount > 1 else int(amount * len(rows))
        if not 0 <= n <= len(rows):
            raise DataError(f"dataset_mixer asks {n} rows of {name!r} ({split} split), which has {len(rows)}; give a "
                            f"count up to {len(rows)} or a fraction up to 1.0")
        parts.append(rows.select(range(n)))
    common = [c for c in parts[0].column_names if all(c in p.column_names for p in parts)]
    return datasets.concatenate_datasets([p.select_columns(common) for p in parts])


def assistant_messages(completions) -> list:
    """Chat data's completions as reward functions and judges read them: each text as one assistant message."""
    return [[{"role": "assistant", "content": c}] for c in completions]


def is_preference(ds) -> bool:
    return {"chosen", "rejected"} <= set(ds.column_names)


def set_chat_template(tokenizer, path: str | None):
    """TRL SFT's ``chat_template_path`` on ``tokenizer`` (returned): the template of a Jinja file, or that of another
    tokenizer (a directory, a ``.gguf`` file or a hub id). None: the tokenizer's own. Unlike TRL's
    ``clone_chat_template``, no token is added and no embedding resized: special tokens that the template writes and
    the vocabulary lacks are tokenized as text."""
    if not path:
        return tokenizer
    file = Path(path).expanduser()
    if file.is_file() and file.suffix != ".gguf":
        tokenizer.chat_template = file.read_text()
        return tokenizer
    from jodpo.models import load_tokenizer

    try:
        template = load_tokenizer(path).chat_template
    except CheckpointError as e:
        raise ConfigError(f"chat_template_path: {e} (it takes a Jinja template file, or a tokenizer directory, .gguf "
                          "file or hub id)") from None
    if template is None:
        raise ConfigError(f"chat_template_path: {path}'s tokenizer has no chat template either; give a Jinja template "
                          "file, or a tokenizer that has one")
    tokenizer.chat_template = template
    return tokenizer


def check_chat_template(tokenizer, prompts) -> None:
    """Chat prompts need a chat template: one line naming the tokenizer and the fix, before anything is read or
    compiled (transformers says it only when asked to render, and not how to give one)."""
    if tokenizer.chat_template is None and any(isinstance(p, list) for p in prompts):
        name = getattr(tokenizer, "name_or_path", "") or "built in code"
        raise DataError(f"the prompts are chat messages and the policy's tokenizer ({name}) has no chat template (a "
                        "base model's often has none); give one with chat_template_path (a Jinja template file, or a "
                        "tokenizer directory or hub id whose template to use, as TRL's SFT takes it), or give text "
                        "prompts")


def render_prompts(tokenizer, prompts: list, template_kwargs: list | None = None) -> list[str]:
    """Every row's prompt as the policy reads it (``render_prompt``); a row that cannot be rendered is a
    ``DataError`` naming it (counting from 1, as the lines of a JSON Lines file)."""
    import jinja2

    check_chat_template(tokenizer, prompts)
    out = []
    for row, (prompt, kwargs) in enumerate(zip(prompts, template_kwargs or [None] * len(prompts)), 1):
        if isinstance(prompt, list) and not prompt:
            raise DataError(f"row {row} of the dataset (counting from 1): the prompt is an empty list of messages; "
                            "give every chat prompt at least one message, or drop the row")
        try:
            out.append(render_prompt(tokenizer, prompt, kwargs))
        except DataError as e:
            raise DataError(f"row {row} of the dataset (counting from 1): {e}") from None
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise DataError(f"row {row} of the dataset (counting from 1): the chat template cannot render its "
                            f"messages ({type(e).__name__}: {e}); fix the row (roles and contents as the template "
                            "expects them)") from None
    return out


def render_prompt(tokenizer, prompt, template_kwargs: dict | None = None) -> str:
    """A prompt as the policy reads it: text as it is, chat messages through the tokenizer's chat template with the
    generation prompt; ``template_kwargs`` (a row's ``chat_template_kwargs`` column, as TRL reads it: Qwen3's
    ``{"enable_thinking": False}``, say) go to the template."""
    if isinstance(prompt, list):  # chat messages
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False,
                                             **(template_kwargs or {}))
    if not isinstance(prompt, str):
        raise DataError(f"a prompt must be text or a list of chat messages, got {type(prompt).__name__}")
    return prompt


def _tokenize(tokenizer, texts: list[str]) -> list[np.ndarray]:
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [np.asarray(x, np.int32) for x in enc]


def _truncate_left(seqs: list[np.ndarray], limit: int, what: str) -> list[np.ndarray]:
    n = sum(len(s) > limit for s in seqs)
    if n == len(seqs) and n:
        raise DataError(f"all {n} {what} are longer than max_prompt_length={limit} tokens; raise max_prompt_length")
    if n:
        import warnings

        warnings.warn(f"{n} of {len(seqs)} {what} are longer than max_prompt_length={limit}; keeping their last "
                      f"{limit} tokens")
    return [s[-limit:] for s in seqs]


@dataclasses.dataclass
class PromptData:
    prompts: list  # as in the dataset (text or messages), for callable rewards and text reward models
    ids: list[np.ndarray]  # tokenized, left-truncated to max_prompt_length
    columns: dict[str, list]  # the other columns, passed to callable rewards
    references: list[str] | None  # the `completion` column, if any (for eval/win_rate)

    def __len__(self):
        return len(self.ids)


def with_bos(seqs: list[np.ndarray], bos_token_id: int | None) -> list[np.ndarray]:
    """Each prompt with ``bos_token_id`` first unless it starts with it already (TRL 1.12's ``tokenize_row``, which
    its Nash-MD and XPO trainers tokenize with); None: as they are."""
    if bos_token_id is None:
        return seqs
    return [s if len(s) and s[0] == bos_token_id else np.concatenate([np.int32([bos_token_id]), s]).astype(np.int32)
            for s in seqs]


def prepare_prompts(ds, tokenizer, max_prompt_length: int, bos_token_id: int | None = None) -> PromptData:
    """The prompts of ``ds`` rendered (chat template) and tokenized without special tokens, ``bos_token_id`` put first
    where given (``with_bos``), left-truncated to ``max_prompt_length``."""
    if "prompt" not in ds.column_names:
        raise DataError(f"the dataset has no 'prompt' column (columns: {ds.column_names}); online DPO needs prompts, "
                        "offline DPO needs prompt/chosen/rejected")
    if len(ds) == 0:
        raise DataError("the dataset is empty")
    prompts = list(ds["prompt"])
    refuse_images(ds.column_names, prompts)
    kwargs = list(ds["chat_template_kwargs"]) if "chat_template_kwargs" in ds.column_names else None
    texts = render_prompts(tokenizer, prompts, kwargs)  # first: a row that cannot be rendered is an error, no warning
    empty = sum(_is_empty(p) for p in prompts)
    if empty:
        import warnings

        warnings.warn(f"{empty} of {len(prompts)} prompts are empty; they train on completions of nothing (the "
                      "model's text from its start); drop those rows if that is not meant", stacklevel=2)
    ids = _truncate_left(with_bos(_tokenize(tokenizer, texts), bos_token_id), max_prompt_length, "prompts")
    columns = {c: list(ds[c]) for c in ds.column_names if c != "prompt"}
    refs = columns.get("completion")
    return PromptData(prompts, ids, columns, [_reference_text(r) for r in refs] if refs is not None else None)


IMAGE_COLUMNS = ("images", "image")  # TRL's vision-language datasets' (prompt-only: "images")
_IMAGE_PARTS = ("image", "image_url", "video")


def refuse_images(columns, prompts) -> None:
    """jodpo trains a vision-language checkpoint's language model on text (its vision tower is left out when it is
    read), so a dataset that carries images (TRL's ``images`` column, or image parts in its chat messages) is refused
    in one line naming the column, rather than trained on its text alone unsaid."""
    why = ("jodpo trains a vision-language checkpoint's language model on text prompts (its vision tower is left "
           "out) and passes no images to it")
    for c in IMAGE_COLUMNS:
        if c in columns:
            raise DataError(f"the dataset has an {c!r} column: {why}; drop the column (dataset.remove_columns("
                            f"{c!r})) and any image parts of the prompts to train on their text")
    for p in prompts:
        for m in p if isinstance(p, list) else ():
            parts = m.get("content") if isinstance(m, dict) else None
            if isinstance(parts, list) and any(isinstance(x, dict) and x.get("type") in _IMAGE_PARTS for x in parts):
                raise DataError(f"the dataset's 'prompt' column holds messages with image parts: {why}; give the "
                                "prompts as text")


def _is_empty(prompt) -> bool:
    """An empty or blank text prompt, or chat messages with no text."""
    if isinstance(prompt, list):
        return not "".join(str(m.get("content") or "") for m in prompt).strip()
    return not str(prompt or "").strip()


def _reference_text(completion) -> str:
    """A reference completion as text: chat data's completion messages give their contents."""
    if isinstance(completion, list):
        return "".join(str(m["content"]) for m in completion)
    return str(completion)


@dataclasses.dataclass
class PreferenceData:
    prompt_ids: list[np.ndarray]
    chosen_ids: list[np.ndarray]  # response tokens (EOS included)
    rejected_ids: list[np.ndarray]

    def __len__(self):
        return len(self.prompt_ids)


def _response_text(tokenizer, prompt, response) -> str:
    if isinstance(prompt, list):  # chat: the rendered conversation minus the rendered prompt
        head = render_prompt(tokenizer, prompt)
        full = tokenizer.apply_chat_template(prompt + list(response), tokenize=False)
        if not full.startswith(head):
            raise DataError("the chat template renders the prompt differently inside the conversation; "
                            "use standard (text) preference data")
        return full[len(head):]
    return response + (tokenizer.eos_token or "")  # TRL's DPOTrainer appends EOS to text responses


def prepare_preferences(ds, tokenizer, max_prompt_length: int, max_response_length: int) -> PreferenceData:
    missing = {"prompt", "chosen", "rejected"} - set(ds.column_names)
    if missing:
        raise DataError(f"preference data needs prompt, chosen and rejected columns; missing {sorted(missing)}")
    if len(ds) == 0:
        raise DataError("the dataset is empty")
    prompts = list(ds["prompt"])
    refuse_images(ds.column_names, prompts)
    prompt_ids = _truncate_left(_tokenize(tokenizer, render_prompts(tokenizer, prompts)), max_prompt_length,
                                "prompts")

    def responses(col):
        return [s[:max_response_length] for s in _tokenize(
            tokenizer, [_response_text(tokenizer, p, r) for p, r in zip(prompts, ds[col])])]

    return PreferenceData(prompt_ids, responses("chosen"), responses("rejected"))


def fingerprint(data: "PromptData | PreferenceData") -> str:
    """A digest of what a run trains on, which a resumed run checks: the prompts as the dataset gives them (text or
    messages; their tokenization may change with the config), or for preference data the tokenized prompts and
    responses (what the loss reads)."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(data, PromptData):
        for p in data.prompts:
            h.update(json.dumps(p, sort_keys=True).encode() + b"\0")
    else:
        for s in (*data.prompt_ids, *data.chosen_ids, *data.rejected_ids):
            h.update(np.int64(len(s)).tobytes() + np.asarray(s, np.int32).tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# Order and batches
# --------------------------------------------------------------------------------------------------


def steps_per_epoch(n_rows: int, global_batch: int) -> int:
    if n_rows < global_batch:
        raise DataError(f"the dataset has {n_rows} rows, fewer than one step's {global_batch} prompts "
                        "(per_device_train_batch_size x devices x gradient_accumulation_steps)")
    return n_rows // global_batch  # the last partial batch is dropped: every step has the same shape


def batch_indices(n_rows: int, global_batch: int, seed: int, step: int) -> np.ndarray:
    """Row indices of optimizer step ``step``: a fresh permutation every epoch, from the seed."""
    spe = steps_per_epoch(n_rows, global_batch)
    epoch, k = divmod(step, spe)
    perm = np.random.default_rng([seed, epoch]).permutation(n_rows)
    return perm[k * global_batch:(k + 1) * global_batch]


def default_buckets(max_prompt_length: int) -> tuple[int, ...]:
    """Powers of two from 16 up to (and including) max_prompt_length: few shapes, at most 2x padding."""
    out, b = [], 16
    while b < max_prompt_length:
        out.append(b)
        b *= 2
    return tuple(out) + (max_prompt_length,)


def left_pad(seqs: list[np.ndarray], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((len(seqs), length), pad_id, np.int32)
    mask = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, -len(s):], mask[i, -len(s):] = s, 1
    return ids, mask


def right_pad(seqs: list[np.ndarray], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((len(seqs), length), pad_id, np.int32)
    mask = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    return ids, mask


def bucket(n: int, buckets: tuple[int, ...]) -> int:

    return bucket_length(max(n, 1), buckets)


def prompt_batch(seqs: list[np.ndarray], accumulation: int, buckets: tuple[int, ...], pad_id: int):
    """i32[A, B, P] ids and mask, left-padded to the bucket of the longest prompt of the window."""
    P = bucket(max(len(s) for s in seqs), buckets)
    ids, mask = left_pad(seqs, P, pad_id)
    return ids.reshape(accumulation, -1, P), mask.reshape(accumulation, -1, P)
