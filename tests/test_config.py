"""The config: TRL's names and defaults, config files, --config.FIELD=VALUE overrides, --help, docs."""
import os
import re
from pathlib import Path

import pytest

from jodpo.program import config as C
from jodpo import train


def test_trl_defaults():
    c = C.TrainConfig()
    assert (c.learning_rate, c.beta, c.loss_type, c.temperature, c.max_new_tokens, c.max_length) == (
        5e-7, 0.1, "sigmoid", 0.9, 64, 512)
    assert (c.per_device_train_batch_size, c.gradient_accumulation_steps, c.num_train_epochs, c.max_steps) == (
        8, 1, 3.0, -1)
    assert (c.max_grad_norm, c.adam_beta1, c.adam_beta2, c.adam_epsilon, c.weight_decay, c.seed) == (
        1.0, 0.9, 0.999, 1e-8, 0.0, 42)
    assert (c.logging_steps, c.bf16, c.gradient_checkpointing, c.lr_scheduler_type) == (10, True, True, "linear")


def test_overrides_are_typed():
    assert C.parse_override("--config.beta=[0.1, 0.2]") == ("beta", (0.1, 0.2))
    assert C.parse_override("--config.beta=0.3") == ("beta", 0.3)
    assert C.parse_override("--config.learning_rate=1") == ("learning_rate", 1.0)
    assert C.parse_override("--config.output_dir=runs/1") == ("output_dir", "runs/1")
    assert C.parse_override("--config.output_dir=123") == ("output_dir", "123")
    assert C.parse_override("--config.missing_eos_penalty=None") == ("missing_eos_penalty", None)
    assert C.parse_override("--config.reward_funcs=['a:b']") == ("reward_funcs", ("a:b",))
    with pytest.raises(C.ConfigError, match="Did you mean 'learning_rate'"):
        C.parse_override("--config.learnin_rate=1e-6")
    with pytest.raises(C.ConfigError, match="'max_steps' wants int"):
        C.parse_override("--config.max_steps=1.5")
    with pytest.raises(C.ConfigError, match="bf16"):
        C.parse_override("--config.bf16=yes")


@pytest.mark.parametrize("field,value,match", [("beta", 0.0, "beta must be > 0"), ("learning_rate", -1.0, "learning_rate"),
                                               ("loss_type", "dpo", "unknown loss_type"),
                                               ("per_device_train_batch_size", 0, "per_device_train_batch_size"),
                                               ("attn_implementation", "flash", "attn_implementation must be one of"),
                                               ("decode_attn_implementation", "flash",
                                                "decode_attn_implementation must be one of"),
                                               ("matmul_precision", "tf32", "matmul_precision must be one of"),
                                               ("total_episodes", 0, "total_episodes must be >= 1"),
                                               ("rdpo_alpha", 0.1, "rdpo_alpha is R-DPO's length term"),
                                               ("ld_alpha", 1.5, r"ld_alpha must be in \[0, 1\]"),
                                               ("num_generations", 1, "num_generations must be >= 2"),
                                               ("pairing", "top2", "pairing must be one of"),
                                               ("sync_steps", 0, "sync_steps must be >= 1"),
                                               ("temperature_scaled_logprobs", True, None)])
def test_bad_values_are_refused(field, value, match):
    if match is None:  # valid alone, refused beside another field
        with pytest.raises(C.ConfigError, match=field):
            C.TrainConfig(**{field: value, "temperature": 0.0})
        return
    with pytest.raises(C.ConfigError, match=match):
        C.TrainConfig(**{field: value})


def test_sync_steps_must_be_a_multiple_of_a_rollouts_updates():
    with pytest.raises(C.ConfigError, match="sync_steps=3 is not a multiple of the 2 optimizer steps of a rollout"):
        C.TrainConfig(sync_steps=3, num_mini_batches=2)
    assert C.TrainConfig(sync_steps=4, num_mini_batches=2).sync_steps == 4
    assert C.TrainConfig(num_mini_batches=2).sync_steps == 1  # on-policy: refreshed every rollout


def test_run_length_from_steps_episodes_or_epochs():
    from jodpo.program.run import run_length

    assert run_length(C.TrainConfig(max_steps=7), 16, 100) == 7
    assert run_length(C.TrainConfig(total_episodes=1000), 16, 100) == 62  # open-instruct: total_episodes // batch
    assert run_length(C.TrainConfig(num_train_epochs=1.5), 16, 100) == 150
    with pytest.raises(C.ConfigError, match="max_steps unset"):
        C.TrainConfig(total_episodes=1000, max_steps=5)
    with pytest.raises(C.ConfigError, match="less than one step's 16 prompts"):
        run_length(C.TrainConfig(total_episodes=10), 16, 100)


def test_auto_attention_is_cudnn_only_where_it_runs_and_pays(monkeypatch):
    """attn_implementation="auto" (the default) is cuDNN's flash attention on an Ampere-or-later NVIDIA GPU in bf16 for
    heads of <= 128 dims without soft-capping, unless the run must be deterministic; splash attention on TPUs in bf16;
    jodpo's XLA attention elsewhere."""
    import types

    import jax

    from jodpo.program.backend import attention_kernel

    def fake(head_dim, softcap=0.0, global_dim=None):  # a model's attention kinds and their heads
        dims = {"attention": head_dim} | ({} if global_dim is None else {"global_attention": global_dim})
        return types.SimpleNamespace(head_dim=head_dim, attn_softcap=softcap, kinds=tuple(dims),
                                     attention_of=lambda kind: types.SimpleNamespace(head_dim=dims[kind]))

    model = fake(128)
    assert C.TrainConfig().attn_implementation == "auto"
    h100 = types.SimpleNamespace(compute_capability="9.0")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [h100])
    assert attention_kernel(C.TrainConfig(bf16=True), model) == "cudnn"
    assert attention_kernel(C.TrainConfig(bf16=False), model) == "xla"
    assert attention_kernel(C.TrainConfig(bf16=True, deterministic=True), model) == "xla"
    assert attention_kernel(C.TrainConfig(bf16=True), fake(256)) == "xla"
    assert attention_kernel(C.TrainConfig(bf16=True), fake(128, global_dim=512)) == "xla"  # Gemma 4's global layers
    assert attention_kernel(C.TrainConfig(bf16=True), fake(64, softcap=50.0)) == "xla"
    assert attention_kernel(C.TrainConfig(bf16=True, attn_implementation="xla"), model) == "xla"
    monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(compute_capability="7.0")])  # a V100
    assert attention_kernel(C.TrainConfig(bf16=True), model) == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # splash attention, in bf16
    assert attention_kernel(C.TrainConfig(bf16=True), model) == "splash"
    assert attention_kernel(C.TrainConfig(bf16=False), model) == "xla"


def test_splash_attention_needs_bf16():
    with pytest.raises(C.ConfigError, match="attn_implementation='splash' needs bf16=True"):
        C.TrainConfig(attn_implementation="splash", bf16=False)
    assert C.TrainConfig(attn_implementation="splash", bf16=True).attn_implementation == "splash"


def test_auto_decode_attention_is_the_pallas_kernel_on_tpus_only(monkeypatch):
    import jax

    from jodpo.program.backend import decode_attention_kernel

    for backend, kernel in (("tpu", "pallas"), ("gpu", "xla"), ("cpu", "xla")):
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        assert decode_attention_kernel(C.TrainConfig()) == kernel
        assert decode_attention_kernel(C.TrainConfig(decode_attn_implementation="xla")) == "xla"


def test_cudnn_attention_needs_bf16_and_a_gpu():
    cfg = C.TrainConfig(model_name_or_path="/no/such/model", attn_implementation="cudnn", bf16=True)
    with pytest.raises(C.ConfigError, match="attn_implementation='cudnn' needs bf16=True"):
        C.TrainConfig(attn_implementation="cudnn", bf16=False)
    import jax

    from jodpo.program.run import build

    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is jax's backend: cudnn is allowed here")
    with pytest.raises(C.ConfigError, match=f"needs an NVIDIA GPU, and jax's backend is {jax.default_backend()}"):
        build(cfg)  # before anything is loaded (the model path does not exist)


def test_max_new_tokens_at_least_max_length_warns():
    with pytest.warns(UserWarning, match="max_new_tokens"):
        C.TrainConfig(max_new_tokens=64, max_length=64)


def test_config_files_by_name_and_path(tmp_path):
    assert C.load_config_file("tldr").model_name_or_path == "trl-lib/pythia-1b-deduped-tldr-sft"
    assert C.load_config_file("tldr_6.9b.py").gradient_accumulation_steps == 4
    f = tmp_path / "mine.py"
    f.write_text("def get_config():\n    return {'learning_rate': 1e-5, 'beta': [0.1, 0.05]}\n")
    c = C.load_config_file(str(f))
    assert c.learning_rate == 1e-5 and c.beta == (0.1, 0.05)
    f.write_text("def get_config():\n    return {'lerning_rate': 1e-5}\n")
    with pytest.raises(C.ConfigError, match="unknown field"):
        C.load_config_file(str(f))
    with pytest.raises(C.ConfigError, match="not found"):
        C.load_config_file("no_such_config.py")


def test_cli_errors_are_one_line_without_traceback(capsys):
    assert train.main(["--config", "no_such_config.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jodpo.train: error: config file 'no_such_config.py' not found") and "Traceback" not in err
    assert train.main(["--config", "tldr.py", "--config.beta=-1"]) == 2
    assert "beta must be > 0" in capsys.readouterr().err


def test_help_lists_every_field_and_docs_document_them(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    out = capsys.readouterr().out
    doc = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    for name, f in C.FIELDS.items():
        assert f"  --{name} " in out and " ".join(f.metadata["help"][:30].split()) in " ".join(out.split())
        assert f"`{name}`" in doc, f"docs/config.md does not document {name}"


@pytest.mark.parametrize("body,line,phrase", [
    ("from jodpo.program.config import TrainConfig\ndef get_config():\n    return TrainConfig(max_steps=3\n", 3,
     "SyntaxError: '(' was never closed; fix the file"),
    ("from jodpo.program.config import TrainConfig\nimport no_such_module\n", 2,
     "ModuleNotFoundError: No module named 'no_such_module'; fix the file"),
    ("def get_config():\n    steps = 3\n    return {'max_steps': stepz}\n", 3, "NameError: name 'stepz' is not defined"),
])
def test_a_config_file_that_fails_is_named_with_its_line(body, line, phrase, tmp_path, capsys):
    f = tmp_path / "broken.py"
    f.write_text(body)
    assert train.main(["--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jodpo.train: error: config file {f}, line {line}: {phrase}"), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_trl_style_flags_as_trls_parser_reads_them(tmp_path):
    """TRL's ``--FIELD VALUE`` (HfArgumentParser: booleans bare, as a word, or --no_FIELD; lists as several words;
    dict fields as JSON) beside --config.FIELD=VALUE, which is applied last; mistakes are one ConfigError."""
    cfg, _ = train.parse_args(["--config", "tldr.py", "--beta", "0.2", "--learning_rate", "5e-7", "--bf16", "false",
                               "--reward_funcs", "a:f", "b:g", "--reward_model_path", "None", "--config.max_steps=3"])
    assert (cfg.beta, cfg.learning_rate, cfg.bf16, cfg.reward_funcs, cfg.reward_model_path, cfg.max_steps) == \
        (0.2, 5e-7, False, ("a:f", "b:g"), None, 3)
    cfg, _ = train.parse_args(["--config", "tldr.py", "--bf16", "--beta", "0.1", "0.05", "--no_gradient_checkpointing",
                               "--dataset_name", "", "--dataset_mixer", '{"a.jsonl": 2}', "--beta=0.3",
                               "--config.beta=[0.4, 0.5]"])
    assert (cfg.bf16, cfg.gradient_checkpointing, cfg.dataset_mixer, cfg.beta) == (True, False, {"a.jsonl": 2.0},
                                                                                    (0.4, 0.5))
    cfg, _ = train.parse_args(["--model_name_or_path", "m", "--max_steps", "5"])  # no recipe: TRL's defaults
    assert cfg == C.TrainConfig(model_name_or_path="m", max_steps=5)
    for argv, phrase in ((["--betta", "0.1"], "unknown argument '--betta'. Did you mean '--beta'?"),
                         (["--max_steps", "1.5"], "argument --max_steps: '1.5'"),
                         (["--bf16", "maybe"], "'maybe' is not a boolean"),
                         (["--config.reward_funcs=1"], "a list is written --reward_funcs A B"),
                         (["--max_steps"], "expected one argument")):
        with pytest.raises(C.ConfigError, match=re.escape(phrase)):
            train.parse_args(["--config", "tldr.py", *argv])
    assert C.parse_override("--config.reward_funcs=my_rewards:concise") == ("reward_funcs", ("my_rewards:concise",))


def test_a_yaml_recipe_of_trl_field_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("recipe.yaml").write_text("model_name_or_path: m\nbeta: [0.2]\nbf16: false\nreward_funcs: [a:f]\n"
                                   "env:\n  JODPO_TEST_RECIPE_ENV: '1'\n")
    monkeypatch.delenv("JODPO_TEST_RECIPE_ENV", raising=False)
    cfg, _ = train.parse_args(["--config", "recipe.yaml", "--learning_rate", "1e-6"])
    assert (cfg.model_name_or_path, cfg.beta, cfg.bf16, cfg.reward_funcs, cfg.learning_rate) == \
        ("m", 0.2, False, ("a:f",), 1e-6)
    assert os.environ["JODPO_TEST_RECIPE_ENV"] == "1"  # TrlParser's env mapping
    Path("bad.yaml").write_text("model_name_or_path: m\nlearnin_rate: 1\n")
    with pytest.raises(C.ConfigError, match="bad.yaml: unknown field.*Did you mean 'learning_rate'"):
        train.parse_args(["--config", "bad.yaml"])
    with pytest.raises(C.ConfigError, match="no/such.yaml not found"):
        train.parse_args(["--config", "no/such.yaml"])


def test_overriding_the_training_data_drops_the_recipes_evaluation_set(tmp_path, capsys):
    """A recipe's eval_dataset belongs to its data: --dataset_name without --eval_dataset drops it (said in one line),
    so evaluation never runs the recipe's prompts with the user's rewards; given together, both are kept."""
    recipe = C.load_config_file("tiny.py")
    assert recipe.eval_dataset and recipe.eval_strategy == "steps"
    cfg, args = train.parse_args(["--config", "tiny.py", "--dataset_name", "mine.jsonl"])
    assert (cfg.dataset_name, cfg.eval_dataset, cfg.eval_steps) == ("mine.jsonl", None, recipe.eval_steps)
    assert args.notes == [f"dataset_name overridden, so the recipe's eval_dataset={recipe.eval_dataset!r} is dropped "
                          "(it belongs to the recipe's data): evaluation (eval_strategy='steps') now runs on "
                          "dataset_name's 'train' split; give --eval_dataset to evaluate on another set"]
    cfg, args = train.parse_args(["--config", "tiny.py", "--config.dataset_name=mine.jsonl", "--eval_strategy", "no"])
    assert cfg.eval_dataset is None and args.notes[0].endswith("evaluation is off; give --eval_dataset to evaluate "
                                                               "on another set")
    for argv in (["--dataset_name", "mine.jsonl", "--eval_dataset", "other.jsonl"],  # both given: both kept
                 ["--dataset_name", recipe.dataset_name],  # the recipe's own data
                 ["--beta", "0.2"]):
        cfg, args = train.parse_args(["--config", "tiny.py", *argv])
        assert cfg.eval_dataset == (argv[3] if len(argv) > 2 else recipe.eval_dataset) and args.notes == []
    out = tmp_path / "run"  # the command says it once, before the run starts (which then fails on the missing file)
    assert train.main(["--config", "tiny.py", "--dataset_name", str(tmp_path / "mine.jsonl"),
                       f"--config.output_dir={out}"]) == 2
    said = capsys.readouterr().out
    assert said.count("is dropped (it belongs to the recipe's data)") == 1, said
