"""TRL's Pythia-2.8B TL;DR recipe: the 1B recipe (tldr.py) with the 2.8B SFT policy and reward model."""
from jodpo.program.config import load_config_file


def get_config():
    return load_config_file("tldr.py").replace(
        model_name_or_path="trl-lib/pythia-2.8b-deduped-tldr-sft",
        reward_model_path="trl-lib/pythia-2.8b-deduped-tldr-rm",
        output_dir="pythia-2.8b-deduped-tldr-online-dpo",
    )
