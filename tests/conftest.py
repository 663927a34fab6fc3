import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["JODPO_CACHE"] = tempfile.mkdtemp(prefix="jodpo-cache-")  # the tiny world is built fresh per session

import pytest

from tests import hf_fixtures


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{family variant: {"causal_lm": dir, "reward": dir}}, built once per test session."""
    return hf_fixtures.build_checkpoints(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="session")
def tokenizer_dir(checkpoints):
    return next(iter(checkpoints.values()))["causal_lm"]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The embedded default (configs/tiny.py), run once to the end: 200 steps, checkpoints at 100 and 200."""
    from jodpo import train

    out = tmp_path_factory.mktemp("tiny")
    assert train.main(["--config", "tiny.py", f"--config.output_dir={out}"]) == 0
    return out
