"""``module:function`` strings: the user's reward functions and judges, and the names of jodpo's own modules that an
older run's config.json (or a user's config file) may still hold."""
import importlib

import pytest

from jodpo.errors import ConfigError
from jodpo.program import user_code
from jodpo.program.config import load_config_file
from jodpo.tasks import toy


def test_an_old_runs_reward_function_string_still_imports():
    assert user_code.import_reward_function("jodpo.toy:sentiment_reward") is toy.sentiment_reward
    assert user_code.import_reward_function("jodpo.tasks.toy:sentiment_reward") is toy.sentiment_reward


@pytest.mark.parametrize("old", sorted(user_code.MOVED))
def test_every_moved_module_exists_under_its_new_name_and_not_its_old(old):
    importlib.import_module(user_code.MOVED[old])
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_a_bad_spec_is_one_line_naming_it():
    with pytest.raises(ValueError, match=r"reward function 'nocolon': write it as 'module.path:name'"):
        user_code.import_reward_function("nocolon")
    with pytest.raises(ValueError, match=r"reward function 'jodpo.tasks.toy:nothing' cannot be imported"):
        user_code.import_reward_function("jodpo.tasks.toy:nothing")


def test_a_config_file_importing_an_old_module_is_told_the_new_name(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("from jodpo.config import TrainConfig\n\n\ndef get_config():\n    return TrainConfig()\n")
    with pytest.raises(ConfigError, match=r"line 1: ModuleNotFoundError: .*jodpo.config is now jodpo.program.config "
                                          r"\(a config file imports TrainConfig as `from jodpo import TrainConfig`\)"):
        load_config_file(str(f))
