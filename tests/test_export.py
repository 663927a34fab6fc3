"""save_hf: a transformers-loadable directory whose logits equal jodpo's; load_model(save_hf(...)) is the identity."""
import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import jodpo
from jodpo.models.export import save_hf
from tests import hf_fixtures


@pytest.mark.parametrize("family", ["neox", "llama", "llama_tied", "mistral", "qwen2", "qwen3", "qwen3_5", "gemma2",
                                    "gemma3", "smollm3", "olmo2", "olmo3", "gemma4", "qwen3_moe", "olmoe",
                                    "qwen3_5_moe"])
@pytest.mark.parametrize("task", ["causal_lm", "reward"])
def test_round_trip_and_transformers_logits(checkpoints, tmp_path, family, task):
    model, params = jodpo.load_model(str(checkpoints[family][task]), task=task)
    params = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape), params)  # "trained"
    tok = jodpo.load_tokenizer(str(checkpoints[family][task]))
    out = save_hf(model, params, tmp_path / "hf", tokenizer=tok)
    model2, params2 = jodpo.load_model(str(out), task=task)
    assert model2 == model
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bitwise in fp32

    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(0), [5, 9], model.pad_token_id, "left")
    cls = AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification
    hf = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    if task == "causal_lm":
        ours = np.asarray(jodpo.logits(model, params, ids, mask))
        np.testing.assert_allclose(ours[mask > 0], theirs[mask > 0], rtol=1e-4, atol=1e-4)
        assert hf.config.tie_word_embeddings == model.tie_embeddings
    else:
        np.testing.assert_allclose(np.asarray(jodpo.reward_scores(model, params, ids, mask)), theirs[:, 0],
                                   rtol=1e-4, atol=1e-4)


def test_refuses_a_non_empty_directory(checkpoints, tmp_path):
    model, params = jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not empty"):
        save_hf(model, params, tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_an_export_is_written_with_the_umask_modes(checkpoints, tmp_path):
    """Readable by the group and others as any file the user writes (safetensors alone writes 0600)."""
    import os

    model, params = jodpo.load_model(str(checkpoints["neox"]["causal_lm"]))
    tok = jodpo.load_tokenizer(str(checkpoints["neox"]["causal_lm"]))
    for umask, file_mode, dir_mode in ((0o022, 0o644, 0o755), (0o027, 0o640, 0o750)):
        old = os.umask(umask)
        try:
            out = save_hf(model, params, tmp_path / f"hf{umask:o}", tokenizer=tok)
        finally:
            os.umask(old)
        assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
        assert out.stat().st_mode & 0o777 == dir_mode
        for f in out.rglob("*"):
            assert f.stat().st_mode & 0o777 == (dir_mode if f.is_dir() else file_mode), f
