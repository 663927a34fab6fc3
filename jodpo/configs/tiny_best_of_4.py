"""Best-of-4 on the embedded tiny world: four completions per prompt, the best against the worst.

`configs/tiny.py` with `num_generations=4` (the pair of each prompt: its highest- against its lowest-rewarded
completion, Xiong et al. 2024; Lanchantin et al. 2025) and half the prompts per step, so a step samples as many
completions (8 prompts x 4 = 16 x 2) and tokens as tiny.py's. docs/pairing.md compares the two
(`python benchmarks/compare_pairing.py`).
"""
from jodpo.program.config import load_config_file


def get_config():
    return load_config_file("tiny.py").replace(num_generations=4, pairing="best_worst", per_device_train_batch_size=8,
                                               output_dir="runs/tiny_best_of_4")
