"""Data loading: open-instruct's dataset_mixer against a plain reference."""
import json

import pytest

from jodpo.program import config as C
from jodpo.program import data as D


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_dataset_mixer_takes_counts_and_fractions_in_order(tmp_path):
    a = _write(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "completion": "x", "extra": i} for i in range(10)])
    b = _write(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "completion": "y"} for i in range(8)])
    mixed = D.load_mixture({a: 0.5, b: 3}, split="train")
    # open-instruct: an amount above 1 is a row count, else a fraction; the first rows of each, concatenated
    assert mixed["prompt"] == [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(3)]
    assert mixed.column_names == ["prompt", "completion"]  # the columns every dataset has
    assert D.load_mixture({a: 1.0}, split="train")["prompt"] == [f"a{i}" for i in range(10)]
    with pytest.raises(D.DataError, match="asks 20 rows"):
        D.load_mixture({b: 20}, split="train")
    assert C.parse_override(f'--config.dataset_mixer={{"{a}": 1, "{b}": 0.25}}') == ("dataset_mixer",
                                                                                   {a: 1.0, b: 0.25})
    with pytest.raises(C.ConfigError, match="dataset_mixer and dataset_name"):
        C.TrainConfig(dataset_mixer={a: 1.0}, dataset_name=b)
    with pytest.raises(C.ConfigError, match="non-negative"):
        C.coerce("dataset_mixer", {a: -1})


def test_chat_prompts_display_as_the_conversation():
    """The completion tables show a chat prompt as the conversation (judges.plain_text), not a Python repr."""
    from jodpo.judges import plain_text

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo <|im_end|> 🙂"}]
    assert plain_text(chat) == "System: Be brief.\n\nUser: Héllo <|im_end|> 🙂\n\n"
    assert plain_text("plain text") == "plain text"


def test_empty_prompts_warn_with_their_count(tokenizer_dir):
    import datasets

    from jodpo.models import load_tokenizer

    rows = datasets.Dataset.from_list([{"prompt": p} for p in ("hello there", "", "  ", "the cat")])
    with pytest.warns(UserWarning, match="2 of 4 prompts are empty; they train on completions of nothing"):
        data = D.prepare_prompts(rows, load_tokenizer(str(tokenizer_dir)), 16)
    assert len(data) == 4 and len(data.ids[1]) == 0
    chat = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": c}]} for c in ("hi", "")])
    assert D._is_empty(chat[1]["prompt"]) and not D._is_empty(chat[0]["prompt"])


def test_a_rows_chat_template_kwargs_reach_the_template_as_in_trl(tokenizer_dir):
    """TRL's maybe_apply_chat_template passes a row's ``chat_template_kwargs`` (Qwen3's ``enable_thinking``) to
    ``apply_chat_template``."""
    import datasets
    from trl.data_utils import maybe_apply_chat_template

    from jodpo.models import load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir))
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not "
                         "enable_thinking %}<think></think>{% endif %}{% endif %}")
    chat = [{"role": "user", "content": "hi"}]
    ds = datasets.Dataset.from_list([{"prompt": chat, "chat_template_kwargs": {"enable_thinking": False}},
                                     {"prompt": chat, "chat_template_kwargs": {"enable_thinking": True}}])
    data = D.prepare_prompts(ds, tok, 256)
    texts = [tok.decode(ids) for ids in data.ids]
    assert texts == [maybe_apply_chat_template(r, tok)["prompt"] for r in ds]
    assert texts[0].endswith("<think></think>") and not texts[1].endswith("</think>")
