"""LoRA adapters: b = 0 is exactly the base model, the adapted forward equals peft's on transformers in every family,
the merged form equals the unmerged one (the sampler's weights too), and a LoRA run trains only its adapters, resumes
exactly and exports (merged and in PEFT's format). Sharded LoRA runs are compared with one device in
tests/test_sharding.py."""
import functools
import json
import shutil

import jax
import numpy as np
import pytest

import jodpo
from jodpo.program import config as C
from jodpo.program import loop
from jodpo.program.checkpoint import restore_params
from jodpo.models import lora
from jodpo.sampling import sampler_params
from tests import helpers, hf_fixtures, references
from tests.subproc import WALL_CLOCK

export_hf = helpers.script("export_hf")


LLAMA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("family,targets", [("neox", None), ("neox", ["all-linear"]), ("llama", ["all-linear"]),
                                            ("qwen2", ["q_proj", "v_proj", "down_proj"]), ("qwen3", None),
                                            ("qwen3_5", ["all-linear"]),
                                            ("gemma2", ["all-linear"]), ("gemma3", None),
                                            ("smollm3", ["q_proj", "v_proj"]), ("olmo3", ["all-linear"]),
                                            ("gemma4", None), ("gemma4", ["all-linear"]), ("qwen3_moe", ["all-linear"]),
                                            ("olmoe", ["q_proj", "gate_proj", "up_proj", "gate"]),
                                            ("qwen3_5_moe", ["all-linear"])])
def test_adapters_are_the_base_at_start_and_equal_peft(checkpoints, tmp_path, family, targets):
    path = checkpoints[family]["causal_lm"]
    base_model, base = jodpo.load_model(str(path))
    model = base_model.replace(lora_rank=4, lora_alpha=8.0)
    names = lora.resolve_targets(model, targets)
    if targets is None:  # PEFT's default target_modules for this model type
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

        model_type = json.loads(model.hf_config)["model_type"]  # gemma4_text: PEFT names gemma4's
        default = PEFT_DEFAULTS.get(model_type) or PEFT_DEFAULTS[model_type.removesuffix("_text")]
        if isinstance(default, str):  # Gemma 4's: a regex over the language model's modules
            import re

            layer = "model.language_model.layers.0.self_attn."
            assert [m for m in LLAMA_MODULES if re.fullmatch(default, layer + m)] == list(names)
        else:
            assert list(names) == default
    if "moe" in family:  # what PEFT adapts: Qwen3.5-MoE's all-linear reaches its shared expert and its gate too;
        # Qwen3-MoE's and OLMoE's expert and router names become target_parameters (gate_up_proj at twice the rank)
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        given = "all-linear" if targets == ["all-linear"] else targets
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                              LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=given))
        theirs, ours = peft.peft_config["default"], lora.peft_config(model, names, 0.05, str(path))
        assert {n.rpartition(".")[2] for n in theirs.target_modules} == set(ours["target_modules"])
        assert set(theirs.target_parameters or ()) == set(ours.get("target_parameters", ()))
        assert (theirs.rank_pattern, theirs.alpha_pattern) == (ours.get("rank_pattern", {}), ours.get("alpha_pattern",
                                                                                                        {}))
    adapters = lora.init_adapters(model, names, jax.random.PRNGKey(0))
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(0), [7, 5], model.pad_token_id, "right")
    plain = np.asarray(jodpo.logits(base_model, base, ids, mask))
    np.testing.assert_array_equal(np.asarray(jodpo.logits(model, lora.attach(base, adapters), ids, mask)), plain)
    # trained adapters: b away from zero
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(1), x.shape), adapters)
    adapted = np.asarray(jodpo.logits(model, lora.attach(base, adapters), ids, mask))
    keep = mask.astype(bool)
    assert np.abs(adapted - plain)[keep].max() > 0.1
    merged = np.asarray(jodpo.logits(base_model, lora.merged(model, base, adapters), ids, mask))
    np.testing.assert_allclose(merged, adapted, rtol=1e-5, atol=1e-5)
    if "deltanet" in base["layers"]:  # the sampler's weights: adapters merged a layer at a time, then side by side,
        # as the merged stack's, put side by side for all the layers at once
        a, b = (jax.jit(functools.partial(sampler_params, m))(p) for m, p in
                ((model, lora.attach(base, adapters)), (base_model, lora.merged(model, base, adapters))))
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
    lora.save_peft(model, adapters, tmp_path / "adapter", names, 0.05, str(path))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    if "target_parameters" not in config:
        assert config["target_modules"] == list(names)
    np.testing.assert_allclose(references.peft_logits(path, tmp_path / "adapter", ids, mask)[keep], adapted[keep], rtol=1e-4,
                               atol=1e-4)


def test_unknown_target_module_names_the_family_s_modules(checkpoints):
    model, _ = jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))
    with pytest.raises(ValueError, match="query_key_value"):
        lora.resolve_targets(model.replace(lora_rank=2, lora_alpha=2.0), ["q_proj"])
    # PEFT has no default target_modules for Qwen3.5 (it refuses target_modules=None): neither has jodpo
    qwen3_5, _ = jodpo.load_model(str(checkpoints["qwen3_5"]["causal_lm"]))
    with pytest.raises(ValueError, match="no default target modules for qwen3_5.*in_proj_qkv"):
        lora.resolve_targets(qwen3_5.replace(lora_rank=2, lora_alpha=2.0), None)
    # Qwen3-MoE's gate_proj and up_proj are one parameter (PEFT refuses one without the other); parameters are named
    # in lora_target_parameters only where LoRA adapts some (PEFT's target_parameters)
    qwen3_moe, _ = jodpo.load_model(str(checkpoints["qwen3_moe"]["causal_lm"]))
    with pytest.raises(ValueError, match=r"\['gate_proj'\] without \['up_proj'\].*gate_up_proj"):
        lora.resolve_targets(qwen3_moe.replace(lora_rank=2, lora_alpha=2.0), ["gate_proj"])
    assert lora.resolve_targets(qwen3_moe, None, ["mlp.experts.down_proj", "gate.weight"]) == ("down_proj",
                                                                                            "gate.weight")
    with pytest.raises(ValueError, match=r"lora_target_parameters \['weight'\] are not.*'gate_up_proj'"):
        lora.resolve_targets(qwen3_moe, None, ["weight"])
    with pytest.raises(ValueError, match=r"lora_target_parameters \['gate_up_proj'\]: this gpt_neox model has no"):
        lora.resolve_targets(model, ["dense"], ["gate_up_proj"])
    with pytest.raises(C.ConfigError, match="lora_r >= 1"):
        C.TrainConfig(use_peft=True, lora_r=0)


@pytest.fixture(scope="module")
def lora_run(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    cfg = C.TrainConfig(model_name_or_path=str(checkpoints["llama"]["causal_lm"]),
                        reward_model_path=str(checkpoints["llama"]["reward"]),
                        dataset_name=str(hf_fixtures.prompt_dataset(root / "data")), output_dir=str(root / "run"),
                        max_steps=4, save_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                        logging_steps=1, max_new_tokens=6, max_length=96, max_prompt_length=64, bf16=False,
                        use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=("all-linear",))
    loop.train(cfg)
    return cfg, root / "run"


def _metrics(out):
    return [{k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_lora_run_trains_only_its_adapters_and_resumes_exactly(lora_run, checkpoints, tmp_path):
    cfg, out = lora_run
    lines = [m for m in _metrics(out) if "loss" in m]
    assert lines[0]["loss"] == pytest.approx(np.log(2), rel=1e-5)  # b = 0: the policy is its reference at first
    assert lines[-1]["loss"] != lines[0]["loss"] and lines[-1]["objective/kl"] != 0
    saved = restore_params(out / "checkpoints" / "4")  # the adapters alone: what changes
    assert sorted(saved) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert all(np.abs(np.asarray(b)).max() > 0 for b in jax.tree.leaves({g: v["b"] for g, v in saved.items()}))
    size = sum(f.stat().st_size for f in (out / "checkpoints" / "4").rglob("*") if f.is_file())
    base_bytes = sum(f.stat().st_size for f in checkpoints["llama"]["causal_lm"].glob("*.safetensors"))
    assert size < base_bytes  # adapters + AdamW moments of rank 4: smaller than the model itself
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "4")
    loop.train(cfg.replace(output_dir=str(resumed)))
    assert _metrics(resumed) == _metrics(out)


def test_a_lora_run_exports_merged_and_as_peft(lora_run, tmp_path):
    _, out = lora_run
    merged, checks = export_hf.export(str(out), str(tmp_path / "merged"))
    assert any("transformers" in c for c in checks), checks
    adapter, checks = export_hf.export(str(out), str(tmp_path / "peft"), peft=True)
    assert any("peft" in c for c in checks), checks
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "tokenizer_config.json").is_file()
    # the merged export and the adapters on the base are one model
    from transformers import AutoModelForCausalLM
    import torch

    ids = np.random.default_rng(1).integers(3, 290, (2, 9))
    mask = np.ones_like(ids)
    base_path = json.loads((out / "config.json").read_text())["model_name_or_path"]
    with torch.no_grad():
        whole = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(references.peft_logits(base_path, adapter, ids, mask), whole, rtol=1e-4, atol=1e-4)
    assert export_hf.main(["--checkpoint", str(out), "--out", str(tmp_path / "again"), "--peft"]) == 0
    # jodpo.generate reads the run as its merged export: the same completions
    from jodpo import generate

    common = ["--max_prompts", "4", "--per_device_eval_batch_size", "4"]
    assert generate.main([str(out), "--out", str(tmp_path / "run.jsonl"), *common]) == 0
    assert generate.main([str(merged), "--out", str(tmp_path / "merged.jsonl"), *common, "--dataset_name",
                          str(out.parent / "data"), "--max_new_tokens", "6", "--max_prompt_length", "64",
                          "--bf16", "False"]) == 0
    assert (tmp_path / "run.jsonl").read_text() == (tmp_path / "merged.jsonl").read_text()
