"""TRL 1.12's ``GeometricMixtureWrapper.generate`` under transformers 4 (trl 1.12.0's other supported major), recorded
beside what it gives under transformers 5 (``generate_tokens``, scripts/record_trl112.py) and the greedy argmax of
the wrapper's own forward over the whole sequence (``tokens``, what jodpo's ``sample_pair`` is tested against):
written as ``generate_tokens_transformers4`` in tests/golden/trl112_mixture_greedy.json, with whether it equals
either. Run by scripts/record_trl112.sh in an environment of its own (trl 1.12.0, transformers 4.57), with the golden
models record_trl112.py kept (``--keep-models``): the families transformers 4 has.

    python scripts/record_trl112_generate.py MODELS_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig
from trl.experimental.nash_md.nash_md_trainer import GeometricMixtureWrapper

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "trl112_mixture_greedy.json"
FAMILIES = ("neox", "llama")  # Qwen3.5 came with transformers 5


def main(argv=None) -> None:
    models = Path((argv or sys.argv[1:])[0]) / "models"
    assert transformers.__version__.startswith("4."), transformers.__version__
    golden = json.loads(GOLDEN.read_text())
    for family in FAMILIES:
        rec = golden[family]
        load = lambda name: AutoModelForCausalLM.from_pretrained(  # noqa: E731
            models / f"{family}-{name}", dtype=torch.float32, attn_implementation="eager")
        policy, ref = load("policy"), load("reference")
        eos, pad = policy.config.eos_token_id, 1
        gen = GenerationConfig(max_new_tokens=len(rec["tokens"][0]), do_sample=False, eos_token_id=eos,
                               pad_token_id=pad)
        wrapper = GeometricMixtureWrapper(policy, ref, gen, mixture_coef=rec["mixture_coef"],
                                          device=torch.device("cpu"))
        ids = torch.tensor(rec["prompt_ids"], dtype=torch.long)
        with torch.no_grad():
            out = wrapper.generate(input_ids=ids, attention_mask=torch.tensor(rec["prompt_mask"]),
                                   generation_config=gen)[:, ids.shape[1]:].tolist()
        out = [row + [pad] * (len(rec["tokens"][0]) - len(row)) for row in out]
        rec["generate_tokens_transformers4"] = out
        print(f"{family}: GeometricMixtureWrapper.generate (transformers {transformers.__version__}) equals its "
              f"generate under transformers 5: {out == rec['generate_tokens']}; the greedy mixture of its forward: "
              f"{out == rec['tokens']}")
    golden["versions"]["transformers4_check"] = transformers.__version__
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    main()
