"""Records TRL 1.12's Nash-MD and XPO (their last release) as golden numbers for tests/test_trl112.py.

TRL 1.12 cannot share the suite's environment (TRL 1.16 there), so this runs in an environment of its own, which
scripts/record_trl112.sh makes (torch 2.13 CPU, transformers 5.24, trl 1.12.0); regenerate with

    bash scripts/record_trl112.sh

It writes tests/golden/trl112_<case>.json for each training case: one ``NashMDTrainer`` or ``XPOTrainer`` step on
the golden models (tests/trl112_fixtures.py), float32 on the CPU, with what the step sampled, the tokenized prompts,
the rewards, the per-token log-probs, the loss, every logged metric and each parameter's gradient norm; and
tests/golden/trl112_mixture_greedy.json: TRL's ``GeometricMixtureWrapper`` decoding greedily (and the smallest gap
between the two best mixed log-probs along the way, so the test knows the argmax is not a near tie).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tests import hf_fixtures
from tests import trl112_fixtures as F

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden"
CASES = {  # name: (trainer, family, settings)
    "nash_md_neox": ("nash_md", "neox", dict(beta=0.1, mixture_coef=0.5, missing_eos_penalty=1.0)),
    "nash_md_qwen3_5": ("nash_md", "qwen3_5", dict(beta=0.3, mixture_coef=0.25, missing_eos_penalty=0.5)),
    "xpo_neox": ("xpo", "neox", dict(beta=0.1, alpha=0.05, loss_type="sigmoid", missing_eos_penalty=1.0)),
    "xpo_llama_ipo": ("xpo", "llama", dict(beta=0.5, alpha=1e-3, loss_type="ipo", missing_eos_penalty=1.0)),
}
MAX_NEW_TOKENS = 8


def _load(paths):
    policy = AutoModelForCausalLM.from_pretrained(paths["policy"], dtype=torch.float32, attn_implementation="eager")
    ref = AutoModelForCausalLM.from_pretrained(paths["reference"], dtype=torch.float32, attn_implementation="eager")
    reward = AutoModelForSequenceClassification.from_pretrained(paths["reward"], dtype=torch.float32,
                                                                attn_implementation="eager")
    return policy, ref, reward


def record_step(paths, trainer_name: str, settings: dict, seed: int, out: Path) -> dict:
    """One step of TRL 1.12's trainer, recorded through its own methods."""
    if trainer_name == "nash_md":
        from trl.experimental.nash_md import NashMDConfig as Config, NashMDTrainer as Trainer
    else:
        from trl.experimental.xpo import XPOConfig as Config, XPOTrainer as Trainer
    tok = AutoTokenizer.from_pretrained(paths["policy"])
    policy, ref, reward = _load(paths)
    args = Config(output_dir=str(out), per_device_train_batch_size=len(F.PROMPTS), max_steps=1,
                  max_new_tokens=MAX_NEW_TOKENS, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                  bf16=False, gradient_checkpointing=False, seed=seed, learning_rate=1e-3, **settings)
    trainer = Trainer(model=policy, ref_model=ref, reward_funcs=reward, args=args, processing_class=tok,
                      train_dataset=Dataset.from_dict({"prompt": F.PROMPTS}))
    rec: dict = {}
    generate, process, rewards, logprobs = (trainer._generate_completions, trainer._process_completions,
                                            trainer._compute_rewards, trainer._compute_logprobs)
    step = trainer.training_step

    def process_completions(model_output, second_output, prompts):
        model_data, second_data = process(model_output, second_output, prompts)
        P = prompts["input_ids"].shape[1]
        rec["prompts"] = list(prompts["raw"])
        rec["prompt_ids"] = prompts["input_ids"].tolist()
        rec["prompt_mask"] = prompts["attention_mask"].tolist()
        for key, data in (("policy", model_data), ("second", second_data)):
            rec[f"{key}_ids"] = data["input_ids"][:, P:].tolist()
            rec[f"{key}_mask"] = data["attention_mask"][:, P:].tolist()
        return model_data, second_data

    def compute_rewards(model_data, second_data, context_length):
        scores = rewards(model_data, second_data, context_length)
        rec["scores"] = [s.tolist() for s in scores]  # after TRL's EOS penalty
        return scores

    def compute_logprobs(*a):
        out = logprobs(*a)
        rec["logprobs"] = [x.detach().tolist() for x in out]  # masked to the completion
        return out

    def training_step(*a, **k):
        loss = step(*a, **k)
        rec["loss"] = float(loss)  # unrounded (the log rounds it to 4 places)
        rec["grad_norms"] = {n: float(p.grad.norm()) for n, p in trainer.model.named_parameters() if p.grad is not None}
        return loss

    trainer._process_completions, trainer._compute_rewards = process_completions, compute_rewards
    trainer._compute_logprobs, trainer.training_step = compute_logprobs, training_step
    trainer.train()
    rec["log"] = trainer.state.log_history[0]
    rec["eos_token_id"], rec["pad_token_id"], rec["bos_token_id"] = tok.eos_token_id, tok.pad_token_id, tok.bos_token_id
    return rec


def has_both(rec: dict) -> bool:
    """Completions with and without the EOS among the recorded ones (both branches of the EOS penalty)."""
    eos = [rec["eos_token_id"] in row for row in rec["policy_ids"] + rec["second_ids"]]
    return any(eos) and not all(eos)


GREEDY = (("neox", 0.5), ("llama", 0.7), ("qwen3_5", 0.3))  # family, mixture_coef


def mixture_greedy(wrapper, ids: np.ndarray, mask: np.ndarray, eos: int, pad: int) -> tuple[list, float]:
    """Greedy decoding from TRL 1.12's ``GeometricMixtureWrapper.forward`` (the log-softmax of the mixed logits) run
    over the whole sequence at each step, as its ``generate`` runs it with transformers 4 (``use_cache=False``):
    ``(tokens [B, T], the smallest gap between the two best mixed log-probs at a chosen step)``."""
    x, m = torch.tensor(ids, dtype=torch.long), torch.tensor(mask)
    done, gaps, out = torch.zeros(len(ids), dtype=torch.bool), [], []
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            logp = wrapper(input_ids=x, attention_mask=m, position_ids=(m.cumsum(1) - 1).clamp(min=0)).logits[:, -1]
            top2 = logp.topk(2, -1).values
            gaps += (top2[:, 0] - top2[:, 1])[~done].tolist()
            token = torch.where(done, torch.tensor(pad), logp.argmax(-1))
            out.append(token)
            x, m = torch.cat([x, token[:, None]], 1), torch.cat([m, (~done).long()[:, None]], 1)
            done |= token == eos
    return torch.stack(out, 1).tolist(), min(gaps)


def record_mixture_greedy(root: Path) -> dict:
    """TRL 1.12's GeometricMixtureWrapper decoding greedily over left-padded prompts of each family (``mixture_greedy``:
    the argmax of its forward over the whole sequence at each step, the mixture it defines); and what its own
    ``generate`` gives in this environment (``generate_tokens``), which parts from that after the first tokens
    (scripts/record_trl112_generate.py records it under transformers 4 too; docs/online_family.md)."""
    from transformers import GenerationConfig
    from trl.experimental.nash_md.nash_md_trainer import GeometricMixtureWrapper

    out = {}
    for family, coef in GREEDY:
        paths = F.build(root, family)
        tok = AutoTokenizer.from_pretrained(paths["policy"])
        policy, ref, _ = _load(paths)
        ids, mask = hf_fixtures.padded_batch(np.random.default_rng(4), [5, 2, 7], tok.pad_token_id, "left")
        gen = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
        wrapper = GeometricMixtureWrapper(policy, ref, gen, mixture_coef=coef, device=torch.device("cpu"))
        tokens, gap = mixture_greedy(wrapper, ids, mask, tok.eos_token_id, tok.pad_token_id)
        with torch.no_grad():
            generated = wrapper.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                                         attention_mask=torch.tensor(mask), generation_config=gen)
        out[family] = {"mixture_coef": coef, "prompt_ids": ids.tolist(), "prompt_mask": mask.tolist(),
                       "tokens": tokens, "min_gap": gap, "generate_tokens": generated[:, ids.shape[1]:].tolist(),
                       "fingerprints": {k: F.fingerprint(paths[k]) for k in ("policy", "reference")}}
    return out


def main(argv=None) -> None:
    import transformers
    import trl

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(GOLDEN))
    parser.add_argument("--keep-models", help="build the golden models here and keep them (for the transformers 4 "
                        "check, scripts/record_trl112_generate.py)")
    parser.add_argument("--only", nargs="*", choices=[*CASES, "mixture_greedy"], help="record these files only")
    args = parser.parse_args(argv)
    assert trl.__version__ == "1.12.0", trl.__version__
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                "command": "bash scripts/record_trl112.sh"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep_models or tmp)
        for name, (trainer, family, settings) in CASES.items():
            if args.only and name not in args.only:
                continue
            paths = F.build(root / "models", family)
            for seed in range(40):  # TRL's draw: the first seed whose completions end with and without EOS
                rec = record_step(paths, trainer, settings, seed, root / f"run-{name}-{seed}")
                if has_both(rec):
                    break
            else:
                raise SystemExit(f"{name}: no seed gave completions with and without EOS")
            rec |= {"case": name, "trainer": trainer, "family": family, "settings": settings, "seed": seed,
                    "max_new_tokens": MAX_NEW_TOKENS, "learning_rate": 1e-3, "versions": versions,
                    "fingerprints": {k: F.fingerprint(paths[k]) for k in ("policy", "reference", "reward")}}
            (out / f"trl112_{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
            print(f"{name}: seed {seed}, loss {rec['loss']:.6f}, grad_norm {rec['log']['grad_norm']:.6f}")
        if args.only and "mixture_greedy" not in args.only:
            return
        greedy = record_mixture_greedy(root / "models")
        (out / "trl112_mixture_greedy.json").write_text(json.dumps(greedy | {"versions": versions}, indent=1) + "\n")
        print("mixture greedy:", {k: v["min_gap"] for k, v in greedy.items()})


if __name__ == "__main__":
    main()
