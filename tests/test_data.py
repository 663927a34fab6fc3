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


def _without_chat_template(src, dst):
    """A copy of the checkpoint ``src`` whose tokenizer has no chat template (as a base model's, or a GGUF file's
    without ``tokenizer.chat_template``)."""
    import shutil

    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").unlink()
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_chat_prompts_and_no_chat_template_are_one_line_before_the_models_load(checkpoints, tmp_path, monkeypatch):
    """The run says it before any weight is read (the data is read before the models), naming the tokenizer and the
    field that gives a template; transformers' own words say neither."""
    from jodpo.program import run as R
    from tests import hf_fixtures

    policy = _without_chat_template(checkpoints["neox"]["causal_lm"], tmp_path / "base")
    data = hf_fixtures.prompt_dataset(tmp_path / "chat", chat=True)
    monkeypatch.setattr(R, "read_policy", lambda *a, **k: pytest.fail("the weights were read before the data"))
    cfg = C.TrainConfig(model_name_or_path=str(policy), reward_model_path=str(checkpoints["neox"]["reward"]),
                        dataset_name=str(data), per_device_train_batch_size=2)
    with pytest.raises(D.DataError) as e:
        R.build(cfg)
    assert str(e.value).startswith(f"the prompts are chat messages and the policy's tokenizer ({policy}) has no chat "
                                   "template (a base model's often has none); give one with chat_template_path (a "
                                   "Jinja template file, or a tokenizer directory or hub id whose template to use")


def test_chat_template_path_takes_a_template_file_or_another_tokenizers(checkpoints, tokenizer_dir, tmp_path):
    """TRL SFT's ``chat_template_path``: a Jinja file, or a tokenizer (directory, .gguf, hub id) that has one."""
    import datasets

    from jodpo.models import load_tokenizer

    base = _without_chat_template(checkpoints["neox"]["causal_lm"], tmp_path / "base")
    rows = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "hello world"}]}])
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    tok = D.set_chat_template(load_tokenizer(str(base)), str(template))
    assert D.render_prompts(tok, rows["prompt"]) == ["user: hello world\nassistant:"]
    tok = D.set_chat_template(load_tokenizer(str(base)), str(tokenizer_dir))  # the fixtures' own template
    assert D.render_prompts(tok, rows["prompt"]) == ["<|user|>hello world<|endoftext|><|assistant|>"]
    assert len(D.prepare_prompts(rows, tok, 64)) == 1
    with pytest.raises(C.ConfigError, match=f"chat_template_path: {base}'s tokenizer has no chat template either"):
        D.set_chat_template(load_tokenizer(str(base)), str(base))
    with pytest.raises(C.ConfigError, match="chat_template_path: /no/such: not a model directory"):
        D.set_chat_template(load_tokenizer(str(base)), "/no/such")


def test_a_prompt_with_no_messages_is_named_by_its_row_without_a_warning(tokenizer_dir, recwarn):
    import datasets

    from jodpo.models import load_tokenizer

    rows = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": c}]} for c in ("hi", "there")] +
                                      [{"prompt": []}])
    with pytest.raises(D.DataError, match=r"^row 3 of the dataset \(counting from 1\): the prompt is an empty list of "
                                          "messages; give every chat prompt at least one message, or drop the row$"):
        D.prepare_prompts(rows, load_tokenizer(str(tokenizer_dir)), 16)
    assert not [w for w in recwarn if "empty" in str(w.message)]  # no "they train on completions of nothing"
    tok = load_tokenizer(str(tokenizer_dir))  # a template that refuses some conversations, as Gemma's does
    tok.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations start with the "
                         "user') }}{% endif %}{{ messages[0]['content'] }}")
    rows = datasets.Dataset.from_list([{"prompt": [{"role": r, "content": "hi"}]} for r in ("user", "assistant")])
    with pytest.raises(D.DataError, match=r"^row 2 of the dataset \(counting from 1\): the chat template cannot render "
                                          r"its messages \(TemplateError: Conversations start with the user\); fix the "
                                          "row"):
        D.prepare_prompts(rows, tok, 16)


def test_a_malformed_json_line_is_one_line_naming_the_file_and_line(tmp_path, capfd):
    good = [json.dumps({"prompt": f"p{i}"}) for i in range(4)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(good[:2] + ['{"prompt": "unfinished'] + good[2:]) + "\n")
    with pytest.raises(D.DataError) as e:
        D.load_rows(str(bad))
    assert str(e.value) == (f"{bad}, line 3: not valid JSON (Unterminated string starting at column 12); each line "
                            "of a JSON Lines file is one JSON object: fix or delete that line")
    out, err = capfd.readouterr()
    assert not out and not err  # datasets' own log lines of the same error (twice) are not shown
    listed = tmp_path / "listed.json"
    listed.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(D.DataError, match=r"listed.json, line 2: a JSON list, not an object"):
        D.load_rows(str(listed))
