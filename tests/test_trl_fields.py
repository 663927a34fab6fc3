"""TRL's fields, every one answered (issue 59, item 3): each field of TRL 1.16's OnlineDPOConfig (transformers'
TrainingArguments beneath it), of TRL 1.12's Nash-MD/XPO configs and of the ModelConfig/ScriptArguments TRL's scripts
parse is a jodpo field or in jodpo.program.trl_fields.TABLE (honoured through a mapping, a no-op with its reason, or
accepted only at the values that mean what jodpo does); unknown names are all said at once, with hints only to fields
of the same meaning; the strategies' schedule is transformers' DefaultFlowCallback's."""
import dataclasses
import re
from pathlib import Path

import pytest

import jodpo
from jodpo import train
from jodpo.errors import ConfigError
from jodpo.program import config as C
from jodpo.program import trl_fields as T
from jodpo.program.schedule import Schedule

# What TRL 1.12 (and earlier TRL versions' example command lines) had beside TRL 1.16's fields: Nash-MD's and XPO's
# own (trl.experimental.nash_md / xpo, not shipped by TRL 1.16), and OnlineDPOConfig fields since removed
TRL_OLDER = {"mixture_coef", "alpha", "judge", "use_transformers_paged", "dataset_num_proc", "gpu_memory_utilization",
             "vllm_guided_decoding_regex", "log_completions"}


def _trl_dataclasses():
    from transformers import TrainingArguments
    from trl import ModelConfig, ScriptArguments
    from trl.experimental.online_dpo import OnlineDPOConfig

    return OnlineDPOConfig, TrainingArguments, ModelConfig, ScriptArguments


def _default(f):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def test_every_field_of_trls_configs_is_jodpos_or_answered_with_trls_default():
    """A TRL release that adds a field fails here until the field is answered."""
    seen = {}
    for cls in _trl_dataclasses():  # the most specific first: OnlineDPOConfig's defaults over TrainingArguments'
        for f in dataclasses.fields(cls):
            seen.setdefault(f.name, (cls.__name__, _default(f)))
    missing = sorted(n for n in set(seen) | TRL_OLDER if n not in C.FIELDS and n not in T.TABLE)
    assert not missing, f"TRL fields neither jodpo's nor answered in trl_fields.TABLE: {missing}"
    assert not set(T.TABLE) & set(C.FIELDS)
    for name, answer in T.TABLE.items():
        assert answer.reason and "\n" not in answer.reason and answer.kind in (T.NOOP, T.ONLY, T.MAPPED), name
        if name in seen:
            assert answer.default == seen[name][1], f"{name}: TRL's default is {seen[name][1]!r}"
        if answer.kind == T.ONLY:
            assert answer.default in answer.accepted and T.check(name, answer.default) == {}
    for name in ("save_strategy", "eval_strategy", "logging_strategy", "logging_first_step", "push_to_hub",
                 "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_revision", "eval_delay",
                 "eval_on_start"):  # honoured as jodpo's fields, with TRL's defaults
        assert C.FIELDS[name].default == seen[name][1], name


def test_docs_hold_the_table():
    doc = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    assert T.markdown_table() in doc, "docs/config.md's table of TRL's other fields is not trl_fields.markdown_table()"


def test_unknown_fields_are_named_at_once_with_hints_of_the_same_meaning(tmp_path):
    with pytest.raises(ConfigError) as e:
        jodpo.OnlineDPOConfig("out", learnin_rate=1e-6, no_such_field=1, evaluation_strategy="steps", fp16=True)
    said = str(e.value)
    assert said.startswith("OnlineDPOConfig: unknown fields 'learnin_rate', 'no_such_field', 'evaluation_strategy'. "
                           "Did you mean 'learning_rate' for 'learnin_rate', 'eval_strategy' for "
                           "'evaluation_strategy'?; fp16=True refused (jodpo takes False): float16 compute is not "
                           "offered"), said
    assert len(said.splitlines()) == 1
    # TRL's own fields are never unknown, so never pointed at a jodpo field of other meaning (save_strategy was
    # once hinted as save_steps)
    assert jodpo.OnlineDPOConfig("out", save_strategy="no", eval_strategy="steps").save_strategy == "no"
    with pytest.raises(ConfigError, match=re.escape("unknown arguments '--betta', '--foo'. Did you mean '--beta' for "
                                                    "'--betta'? unknown field 'lerning_rate'. Did you mean "
                                                    "'learning_rate'? Unexpected word 'x'.")):
        train.parse_args(["--betta", "0.1", "--foo", "--config.lerning_rate=1", "--max_steps", "2", "x"])
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("learnin_rate: 1\nbetta: 0.1\nfp16: true\n")
    with pytest.raises(ConfigError, match=re.escape(f"{recipe}: unknown fields 'learnin_rate', 'betta'. Did you mean "
                                                    "'learning_rate' for 'learnin_rate', 'beta' for 'betta'?; "
                                                    "fp16=True refused (jodpo takes False): float16 compute is not "
                                                    "offered")):
        train.parse_args(["--config", str(recipe)])
    script = tmp_path / "mine.py"
    script.write_text("def get_config():\n    return {'learnin_rate': 1, 'betta': 0.1}\n")
    with pytest.raises(ConfigError, match="unknown fields 'learnin_rate', 'betta'"):
        C.load_config_file(str(script))


@pytest.mark.parametrize("given,phrase", [
    (dict(disable_dropout=False), "jodpo's models run without dropout"),
    (dict(fp16=True), "bf16=True computes in bfloat16"),
    (dict(fsdp="full_shard auto_wrap"), "mesh_fsdp"),
    (dict(deepspeed="ds.json"), "DeepSpeed ZeRO: jodpo shards parameters"),
    (dict(optim="sgd"), "jodpo's optimizer is AdamW"),
    (dict(save_strategy="best"), "jodpo keeps no best checkpoint"),
    (dict(load_best_model_at_end=True), "jodpo keeps no best checkpoint"),
    (dict(generation_kwargs={"num_beams": 4, "temperature": 0.7}), "['num_beams'] have no counterpart"),
    (dict(generation_kwargs={"do_sample": "no"}), "do_sample is True or False, got 'no'"),
    (dict(model_init_kwargs={"dtype": "auto"}), "never the checkpoint's own, 'auto'"),
    (dict(model_init_kwargs={"quantization_config": {}}), "['quantization_config'] have no counterpart"),
    (dict(gradient_checkpointing_kwargs={"every_n_layers": 2}), "no every_n_layers"),
    (dict(generation_kwargs={"temperature": 0.7}, temperature=0.5), "sets temperature=0.7, and temperature=0.5 is "
                                                                    "given too: give one"),
])
def test_refused_values_say_why(given, phrase):
    with pytest.raises(ConfigError, match=re.escape(phrase)):
        jodpo.OnlineDPOConfig("out", **given)


def test_accepted_fields_map_onto_jodpos_or_are_no_ops_said_once():
    cfg = jodpo.OnlineDPOConfig(
        "out", generation_kwargs={"temperature": 0.7, "top_k": 20, "use_cache": True, "do_sample": True},
        model_init_kwargs={"dtype": "bfloat16", "revision": "v2", "trust_remote_code": True}, tf32=True,
        activation_checkpointing=False, gradient_checkpointing_kwargs={"use_reentrant": False}, log_completions=False,
        full_determinism=True, optim="adamw_torch", use_vllm=False, torch_compile=True, vllm_mode="server",
        remove_unused_columns=True, dataloader_num_workers=4, hub_token="hf_secret")
    assert (cfg.temperature, cfg.top_k, cfg.param_dtype, cfg.frozen_param_dtype, cfg.model_revision) == \
        (0.7, 20, "bfloat16", "bfloat16", "v2")
    assert (cfg.matmul_precision, cfg.gradient_checkpointing, cfg.num_sample_generations, cfg.deterministic) == \
        ("high", False, 0, True)
    # read back as a TRL config reads: the value given, else TRL's default; kept through replace()
    again = cfg.replace(beta=0.2)
    assert (again.torch_compile, again.vllm_mode, again.use_cache, again.optim) == (True, "server", False,
                                                                                   "adamw_torch")
    notes = T.notes(again.trl_given)
    assert "torch_compile=True has no effect in jodpo: XLA compiles every program jodpo runs, whatever this says" in \
        notes
    assert any(n.startswith("remove_unused_columns=True has no effect in jodpo: jodpo keeps every column")
               for n in notes)
    assert not any(n.startswith(("optim=", "use_vllm=")) for n in notes)  # what jodpo does anyway: nothing to say
    assert cfg.to_dict()["hub_token"] == "<HUB_TOKEN>" and cfg.hub_token == "hf_secret"  # never in config.json
    # the command line reads them as TRL's parser does: a bare flag is True, several words a list
    cfg, _ = train.parse_args(["--torch_compile", "--use_vllm", "false", "--include_for_metrics", "inputs", "loss",
                               "--push_to_hub", "--save_strategy", "epoch", "--config.generation_kwargs={'top_p': 0.9}",
                               "--model_init_kwargs", '{"torch_dtype": "bfloat16"}'])
    assert (cfg.push_to_hub, cfg.save_strategy, cfg.top_p, cfg.param_dtype) == (True, "epoch", 0.9, "bfloat16")
    assert cfg.trl_given["include_for_metrics"] == ["inputs", "loss"] and cfg.use_vllm is False


def _transformers_flow(args: dict, total: int, per_epoch: int) -> dict[str, list[int]]:
    """The steps at which transformers' DefaultFlowCallback logs, evaluates and saves (on_step_end at each step,
    on_epoch_end at each epoch's end and at the run's end, as Trainer's loop calls them)."""
    from transformers import TrainingArguments
    from transformers.trainer_callback import DefaultFlowCallback, TrainerControl, TrainerState

    targs = TrainingArguments(output_dir="unused", report_to="none", **args)
    state = TrainerState(max_steps=total, logging_steps=targs.logging_steps, save_steps=targs.save_steps,
                         eval_steps=targs.eval_steps or 0)
    flow, out = DefaultFlowCallback(), {"logs": [], "evaluates": [], "saves": []}
    for step in range(1, total + 1):
        state.global_step, state.epoch = step, step / per_epoch
        control = flow.on_step_end(targs, state, TrainerControl())
        if step % per_epoch == 0 or step == total:
            control = flow.on_epoch_end(targs, state, control)
        for what, flag in (("logs", control.should_log), ("evaluates", control.should_evaluate),
                           ("saves", control.should_save)):
            if flag:
                out[what].append(step)
    return out


@pytest.mark.parametrize("args", [
    dict(save_strategy="steps", save_steps=4, eval_strategy="steps", eval_steps=3, logging_steps=2),
    dict(save_strategy="epoch", eval_strategy="epoch", logging_strategy="epoch", logging_first_step=True),
    dict(save_strategy="no", eval_strategy="steps", logging_steps=3, eval_delay=5, logging_first_step=True),
    dict(save_strategy="steps", save_steps=0.25, eval_strategy="epoch", eval_delay=1.5, logging_strategy="no"),
    dict(save_strategy="epoch", eval_strategy="no", logging_strategy="no", logging_first_step=True),
])
def test_the_schedule_is_transformers_flow(args):
    """jodpo logs, evaluates and saves at the steps transformers' Trainer does, for every strategy (jodpo also logs
    the run's last step unless logging_strategy is "no")."""
    total, per_epoch = 11, 4
    want = _transformers_flow(args, total, per_epoch)
    cfg = C.TrainConfig(**args)
    if "save_steps" in args and args["save_steps"] < 1:  # transformers resolves a fraction when training starts
        want["saves"] = _transformers_flow({**args, "save_steps": Schedule(cfg, total, per_epoch).save_every},
                                           total, per_epoch)["saves"]
    schedule = Schedule(cfg, total, per_epoch)
    got = {what: [d for d in range(1, total + 1) if getattr(schedule, what)(d)] for what in want}
    if cfg.logging_strategy != "no" and total not in want["logs"]:
        want["logs"].append(total)
    assert got == want
    assert schedule.saves_after(0) == len(want["saves"]) and schedule.saves_after(5) == len(
        [d for d in want["saves"] if d > 5])


def test_a_push_that_fails_is_one_line_before_the_run_trains(monkeypatch):
    from huggingface_hub import constants

    from jodpo.errors import HubError
    from jodpo.program.hub import Hub

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(HubError, match=re.escape("push_to_hub: creating the repo 'run' at http://127.0.0.1:9 failed (")
                       + r".*; check the network, hub_token \(or \$HF_TOKEN\) and hub_model_id \('run'\); the run's "
                         "checkpoints are intact"):
        Hub(C.TrainConfig(output_dir="/tmp/somewhere/run", push_to_hub=True, hub_token="hf_stand_in"))


def test_all_checkpoints_pushes_each_saves_run_to_a_folder_of_its_own(tmp_path, monkeypatch):
    """hub_strategy="all_checkpoints": besides the policy, each save's resumable run (config.json, source_model/,
    that step's checkpoint) goes to checkpoint-<step>/, the earlier ones kept (the policy's export is stubbed: the
    runs in tests/test_trainer.py push real ones)."""
    from jodpo.program.hub import Hub
    from tests import hub_stand_in

    run = tmp_path / "run"
    for path in ("config.json", "source_model/config.json", "checkpoints/2/state/a", "checkpoints/4/state/a",
                 "metrics.jsonl", "jodpo.lock"):
        (run / path).parent.mkdir(parents=True, exist_ok=True)
        (run / path).write_text(path)
    hub = hub_stand_in.HubStandIn()
    hub_stand_in.patch(hub, monkeypatch)
    try:
        pushes = Hub(C.TrainConfig(output_dir=str(run), push_to_hub=True, hub_strategy="all_checkpoints",
                                   save_strategy="steps"))
        monkeypatch.setattr(pushes, "push_policy", lambda *a, **k: None)
        pushes.push_save(run, 2, 0.5)
        pushes.push_save(run, 4, 1.0)
        assert sorted(hub.files("stand-in-user/run")) == [
            f"checkpoint-{s}/{p}" for s in (2, 4) for p in ("checkpoints/" + str(s) + "/state/a", "config.json",
                                                             "source_model/config.json")]
        assert [c["summary"] for c in hub.commits] == ["Training in progress, step 2, checkpoint",
                                                       "Training in progress, step 4, checkpoint"]
    finally:
        hub.close()
