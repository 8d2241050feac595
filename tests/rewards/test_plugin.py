"""`check_spec`: the driver's check of `task.reward` before any engine starts: the form of the spec, and that its
file or module is there, without running the user's code."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.rewards.plugin import check_spec, load_function

PLUGIN = Path(__file__).with_name("plugin_reward.py")


def test_a_reward_whose_code_is_there_passes_without_running_it() -> None:
    check_spec(f"{PLUGIN}:copies")
    check_spec("tests.rewards.plugin_reward:copies")
    check_spec("json:loads")
    load_function.cache_clear()
    check_spec(f"{PLUGIN}:not_defined_yet")  # the function shows only when an engine loads the module
    assert load_function.cache_info().currsize == 0  # nothing loaded


@pytest.mark.parametrize(
    "spec, message",
    [
        ("copies", "is not 'package.module:function' or 'file.py:function'"),
        ("/nowhere/reward.py:copies", "no Python file at /nowhere/reward.py"),
        ("no_such_package.rewards:copies", "no module 'no_such_package.rewards' on the Python path"),
        ("tests.rewards.no_such_module:copies", "no module 'tests.rewards.no_such_module' on the Python path"),
    ],
)
def test_a_reward_no_engine_could_load_is_named(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"task.reward: .*{message}"):
        check_spec(spec)
