"""Config fields on the command line, in both styles the commands take: TRL's ``--FIELD VALUE`` (as TRL's
``HfArgumentParser`` reads them: ``--bf16`` / ``--bf16 false`` / ``--no_bf16``, lists as ``--reward_funcs a:f b:g``)
and jodpo's ``--config.FIELD=VALUE``; and the recipe a run starts from: a Python config file, a YAML file of TRL
field names (as ``trl ... --config recipe.yaml``), or a bundled config by name.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import json
import typing
from pathlib import Path

from jodpo.errors import ConfigError
from jodpo.program import trl_fields
from jodpo.program.config import FIELDS, TrainConfig, coerce, field_types, find_config_file, from_dict, \
    load_config_file, parse_override


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose mistakes are ``ConfigError``s (one line, and no ``SystemExit`` for a caller that
    is not a command)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        raise ConfigError(message)


def _bool(text: str) -> bool:
    """TRL's ``string_to_bool``: yes/true/t/y/1 and no/false/f/n/0, any case."""
    if text.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if text.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean; use true or false")


def _scalar(t):
    """The converter of one command-line word to ``t``: ``None`` (any case) is None for a field that takes None."""
    if typing.get_origin(t) is dict:
        return json.loads  # TRL's dict fields: a JSON object
    return t


def add_field_flags(parser: argparse.ArgumentParser, names, title: str) -> None:
    """``--FIELD VALUE`` for each of ``names``, typed as TRL's ``HfArgumentParser`` types them."""
    group = parser.add_argument_group(title)
    for name in names:
        f, kinds = FIELDS[name], field_types(name)
        help = f"{f.metadata['help']} (default: {f.default!r})".replace("%", "%%")
        real = [t for t in kinds if t is not type(None)]
        optional = len(real) < len(kinds)
        listed = [t for t in real if typing.get_origin(t) is tuple]
        if real == [bool]:
            group.add_argument(f"--{name}", type=_bool, nargs="?", const=True, default=argparse.SUPPRESS, help=help)
            if f.default is True:  # as HfArgumentParser: --no_FIELD
                group.add_argument(f"--no_{name}", dest=name, action="store_false", default=argparse.SUPPRESS,
                                   help=argparse.SUPPRESS)
            continue
        if listed:
            elem = typing.get_args(listed[0])[0]
            kw = dict(nargs="+", type=_or_none(elem, optional))
        else:
            kw = dict(type=_or_none(_scalar(real[0]), optional))
        group.add_argument(f"--{name}", metavar="VALUE", default=argparse.SUPPRESS, help=help, **kw)


def _or_none(convert, optional: bool):
    def read(text: str):
        if optional and text in ("None", "none"):
            return None
        try:
            return convert(text)
        except (ValueError, json.JSONDecodeError) as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    read.__name__ = getattr(convert, "__name__", "value")
    return read


def given_fields(args: argparse.Namespace, names) -> dict:
    """The fields given as ``--FIELD VALUE``, checked as the config checks them (lists as tuples; a list of one for a
    field that also takes one value is that value, as TRL makes a one-element ``beta`` a float)."""
    out = {}
    for name in names:
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        if isinstance(value, list):
            if len(value) == 1 and isinstance(value[0], str) and value[0].lstrip().startswith(("[", "(")):
                value = ast.literal_eval(value[0])  # the older form: --reward_funcs "['a:f', 'b:g']"
            elif len(value) == 1 and any(t in (str, float, int) for t in field_types(name)):
                value = value[0]
            elif value == [None]:
                value = None
        out[name] = coerce(name, value)
    return out


def add_trl_flags(parser: argparse.ArgumentParser) -> None:
    """``--FIELD [VALUE ...]`` for TRL's other fields (``trl_fields.TABLE``), left out of ``--help`` (docs/config.md
    holds their answers): read as TRL's parser reads them (a bare boolean flag is True, one word a value, several a
    list), for the config to answer. A name the command already has as its own flag (``--debug``) stays the
    command's."""
    for name, answer in trl_fields.TABLE.items():
        if f"--{name}" in parser._option_string_actions:
            continue
        word = _bool if isinstance(answer.default, bool) else _literal
        parser.add_argument(f"--{name}", nargs="*", type=word, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                            dest=f"trl:{name}")


def _literal(text: str):
    """One word of a TRL field's value: JSON or a Python literal (numbers, booleans, None, dicts, lists), else the
    text."""
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(text)
        except (ValueError, SyntaxError):
            continue
    return None if text == "none" else text


def given_trl_fields(args: argparse.Namespace) -> dict:
    """TRL's other fields given as ``--FIELD [VALUE ...]``: a bare flag True, one word its value, several a list."""
    out = {}
    for name in trl_fields.TABLE:
        words = getattr(args, f"trl:{name}", None)
        if words is not None:
            out[name] = True if words == [] else words[0] if len(words) == 1 else words
    return out


def dotted_overrides(rest: list[str], names=None) -> dict:
    """``--config.FIELD=VALUE`` arguments -> {FIELD: value}; every other argument, and every field the command does
    not take (``names``: the fields it takes, default all of jodpo's and TRL's others), is said at once, each with
    the field it most resembles."""
    takes = (lambda n: n in FIELDS or n in trl_fields.TABLE) if names is None else (lambda n: n in names)
    flags, fields, foreign, stray, follows_flag = [], [], [], [], False
    for arg in rest:
        if arg.startswith("--config."):
            name = arg[len("--config."):].split("=", 1)[0]
            if not takes(name):
                (foreign if name in FIELDS else fields).append(name)
            follows_flag = False
        elif arg.startswith("-"):
            flags.append(arg.split("=", 1)[0])
            follows_flag = True
        elif not follows_flag:  # a word after an unknown flag is its value
            stray.append(arg)
    problems = [trl_fields.unknown_line(flags, (), "argument", {f: _hint(f, names) for f in flags})] if flags else []
    if fields:
        problems.append(trl_fields.unknown_line(fields, (), "field", {f: _hint(f, names) for f in fields}))
    problems += [f"this command does not take {name!r}; it takes {', '.join(sorted(names))}." for name in foreign]
    if stray:
        problems.append(f"Unexpected word{'s' if len(stray) > 1 else ''} {', '.join(repr(w) for w in stray)}.")
    if problems:
        raise ConfigError(" ".join(problems) + " Fields are set as --FIELD VALUE (TRL's style) or "
                                               "--config.FIELD=VALUE; --help lists them")
    return dict(parse_override(arg) for arg in rest)


def _hint(given: str, names=None) -> str | None:
    """The field (written as ``given`` is: ``--FIELD`` or ``FIELD``) that ``given`` most resembles, of ``names``
    (default jodpo's fields and TRL's others: ``trl_fields.hint``)."""
    bare = given.lstrip("-")
    close = trl_fields.hint(bare, FIELDS) if names is None else \
        next(iter(difflib.get_close_matches(bare, names, n=1, cutoff=trl_fields.HINT_CUTOFF)), None)
    return None if close is None else given[:len(given) - len(bare)] + close


_TRAIN_DATA = ("dataset_name", "dataset_mixer")
_EVAL_DATA = ("eval_dataset", "dataset_eval_mixer")


def with_overrides(recipe: TrainConfig, overrides: dict) -> tuple[TrainConfig, str | None]:
    """The recipe with the command line's fields, and a line to show when that changes more than the fields given.

    A recipe's evaluation set belongs to the recipe's data: when the training data is overridden (``dataset_name``
    or ``dataset_mixer``) and the evaluation set is not, the recipe's ``eval_dataset`` / ``dataset_eval_mixer`` are
    dropped, as a TRL script evaluates on ``eval_dataset`` only when it is given (else on ``dataset_name``'s
    ``dataset_test_split``, with ``eval_strategy``); otherwise evaluation would silently run the recipe's prompts with
    the user's rewards."""
    note = None
    dropped = {k: getattr(recipe, k) for k in _EVAL_DATA if getattr(recipe, k)}
    changed = [k for k in _TRAIN_DATA if k in overrides and overrides[k] != getattr(recipe, k)]
    if changed and dropped and not any(k in overrides for k in _EVAL_DATA):
        overrides = {**overrides, **dict.fromkeys(dropped)}
    else:
        dropped = {}
    cfg = recipe.replace(**overrides) if overrides else recipe
    if dropped:
        said = ", ".join(f"{k}={v!r}" for k, v in dropped.items())
        where = (f"evaluation (eval_strategy={cfg.eval_strategy!r}) now runs on {' and '.join(changed)}'s "
                 f"{cfg.dataset_test_split!r} split" if cfg.eval_strategy != "no" else "evaluation is off")
        note = (f"{' and '.join(changed)} overridden, so the recipe's {said} is dropped (it belongs to the "
                f"recipe's data): {where}; give --eval_dataset to evaluate on another set")
    return cfg, note


def load_recipe(name: str | None) -> TrainConfig:
    """The run's starting config: none (every field at its TRL default), a YAML file of TRL field names, a Python
    config file, or a bundled config by name."""
    if name is None:
        return TrainConfig()
    if Path(name).suffix in (".yaml", ".yml"):
        return load_yaml(Path(name))
    return load_config_file(name)


def load_yaml(path: Path) -> TrainConfig:
    """A YAML recipe: a mapping of TRL's field names (TrlParser's ``--config``), read as a ``TrainConfig``. Its ``env``
    mapping, as TRL's, sets environment variables before anything else runs."""
    import os

    import yaml

    if not path.is_file():
        raise ConfigError(f"config file {path} not found (looked at {path.resolve()}); relative paths are taken from "
                          "the current directory")
    try:
        d = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: not valid YAML ({str(e).splitlines()[0]}); fix the file") from None
    d = {} if d is None else d
    if not isinstance(d, dict):
        raise ConfigError(f"config file {path}: holds a {type(d).__name__}, not a mapping of field names to values")
    env = d.pop("env", None) or {}
    if not isinstance(env, dict):
        raise ConfigError(f"config file {path}: env must be a mapping of environment variables to values")
    for k, v in env.items():
        os.environ[str(k)] = str(v)
    beta = d.get("beta")
    if isinstance(beta, list) and len(beta) == 1:
        d["beta"] = beta[0]
    return from_dict(d, source=str(path))


__all__ = ["Parser", "add_field_flags", "add_trl_flags", "given_fields", "given_trl_fields", "dotted_overrides",
           "with_overrides", "load_recipe", "find_config_file"]
