"""Loading checkpoints: formats, dtypes, the hub path (offline, from a local cache), and clear errors."""
import json
import shutil
import subprocess
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jodpo.errors import CheckpointError
from jodpo.models.loading import describe_model
import jodpo
from tests import subproc


def _same_params(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def reference(checkpoints):
    return jodpo.load_model(str(checkpoints["llama"]["causal_lm"]))


def test_sharded_safetensors(checkpoints, reference, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["llama"]["causal_lm"])
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model, params = jodpo.load_model(str(tmp_path))
    assert model == reference[0]
    _same_params(params, reference[1])


def test_pytorch_bin(checkpoints, reference, tmp_path):
    src = checkpoints["llama"]["causal_lm"]
    shutil.copy(src / "config.json", tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(src)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    _, params = jodpo.load_model(str(tmp_path))
    _same_params(params, reference[1])


def test_bfloat16_checkpoint_and_dtype(checkpoints, reference, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["llama"]["causal_lm"]).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model, params = jodpo.load_model(str(tmp_path), dtype=jnp.bfloat16)
    assert model.dtype == "bfloat16"
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
    want = jax.tree.map(lambda p: np.asarray(p).astype(ml_dtypes.bfloat16), reference[1])
    _same_params(params, want)
    _, params32 = jodpo.load_model(str(tmp_path), dtype=jnp.float32)  # bf16 file -> f32 params
    _same_params(params32, jax.tree.map(lambda p: np.asarray(p, np.float32), want))


def test_hub_id_from_local_cache_offline(checkpoints, reference, tmp_path, monkeypatch):
    # A hub cache laid out as huggingface_hub writes it; HF_HUB_OFFLINE=1 must resolve the id from it.
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    snap = repo / "snapshots" / ("a" * 40)
    shutil.copytree(checkpoints["llama"]["causal_lm"], snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    model, params = jodpo.load_model("acme/tiny-llama")
    _same_params(params, reference[1])
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE"):
        jodpo.load_model("acme/not-cached")


def test_unsupported_architecture_lists_supported(checkpoints, tmp_path):
    shutil.copytree(checkpoints["llama"]["causal_lm"], tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"GPT2LMHeadModel.*not supported.*Qwen2"):
        jodpo.load_model(str(tmp_path / "m"))


def test_task_must_match_checkpoint_head(checkpoints):
    with pytest.raises(CheckpointError, match="not a sequence classifier"):
        jodpo.load_model(str(checkpoints["neox"]["causal_lm"]), task="reward")
    with pytest.raises(CheckpointError, match="needs a \\*ForCausalLM"):
        jodpo.load_model(str(checkpoints["neox"]["reward"]), task="causal_lm")


def test_reward_with_several_labels_is_refused(checkpoints, tmp_path):
    shutil.copytree(checkpoints["qwen2"]["reward"], tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["id2label"] = {"0": "a", "1": "b"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="2 labels"):
        jodpo.load_model(str(tmp_path / "m"), task="reward")


def test_missing_directory_and_missing_weights(tmp_path):
    with pytest.raises(CheckpointError, match="not a model directory"):
        jodpo.load_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        jodpo.load_model(str(tmp_path / "empty"))


def test_truncated_safetensors_is_a_clear_error(checkpoints, tmp_path):
    shutil.copytree(checkpoints["llama"]["causal_lm"], tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        jodpo.load_model(str(tmp_path / "m"))


def test_tokenizer_loads_left_padded_and_gets_a_pad_token(tokenizer_dir, tmp_path):
    tok = jodpo.load_tokenizer(str(tokenizer_dir))
    assert tok.padding_side == "left" and tok.pad_token == "<|pad|>"
    assert tok.decode(tok("hello world")["input_ids"]) == "hello world"
    cfg_path = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, cfg_path)
    tc = json.loads((cfg_path / "tokenizer_config.json").read_text())
    tc.pop("pad_token", None)
    (cfg_path / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.warns(UserWarning, match="no pad token"):
        tok = jodpo.load_tokenizer(str(cfg_path))
    assert tok.pad_token == tok.eos_token


def test_loading_streams_within_twice_the_model_size(tmp_path):
    """Peak resident memory while loading stays under ~2x the weights (a subprocess measures its RSS)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                      intermediate_size=1536, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    script = textwrap.dedent(f"""
        import resource, jax, jax.numpy as jnp, jodpo
        jax.numpy.zeros(4).block_until_ready()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        m, p = jodpo.load_model({str(tmp_path)!r})
        jax.block_until_ready(p)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
    """)
    python, env = subproc.without_torch(subproc.env())  # as a run loads: torch's own memory not counted
    grown = int(subprocess.run([*python, "-c", script], check=True, capture_output=True, text=True,
                               env=env).stdout.split()[-1])
    assert grown < 2.3 * nbytes, f"loading grew RSS by {grown / nbytes:.2f}x the model size"


def test_every_eos_id_of_the_generation_config_is_taken(checkpoints, tmp_path):
    """Qwen3's generation_config.json lists two EOS ids (<|im_end|>, <|endoftext|>): the model stops at either."""
    shutil.copytree(checkpoints["qwen3"]["causal_lm"], tmp_path / "m")
    eos = jodpo.load_model(str(tmp_path / "m"))[0].eos_token_ids[0]
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 7], "pad_token_id": 1}))
    assert describe_model(str(tmp_path / "m")).eos_token_ids == (eos, 7)


def test_a_parameter_no_rule_fills_is_a_bug_named_before_any_tensor_is_read(checkpoints, monkeypatch):
    """A family whose rules fell behind its parameters (here: the final norm's rule dropped) stops loading at once,
    naming the parameter, instead of returning params without it."""
    from jodpo.models import families, loading

    rules = families.weight_rules

    def fewer(model):
        return [r for r in rules(model) if ("final_norm", "scale") not in r.jodpo]

    monkeypatch.setattr(families, "weight_rules", fewer)
    monkeypatch.setattr(loading, "iter_tensors", lambda path: pytest.fail("a tensor was read"))
    with pytest.raises(NotImplementedError, match=r"llama rules fill no tensor into \['final_norm/scale'\]"):
        jodpo.load_model(str(checkpoints["llama"]["causal_lm"]))
