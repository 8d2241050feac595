"""The suite's xdist scopes (`tests/xdist_scope.py`): the tests of a module sharing a module-scoped fixture go to one
worker together; any other test is a unit of its own."""

from tests.xdist_scope import SharedFixtureScheduling


def _scope(nodeid: str) -> str:
    # _split_scope reads nothing of the scheduler's state: no workers or config are needed to ask it.
    return SharedFixtureScheduling._split_scope(object.__new__(SharedFixtureScheduling), nodeid)


def test_a_module_with_its_own_module_fixture_is_one_unit() -> None:
    module = "tests/rollout/test_data_parallel_engine.py"
    assert _scope(f"{module}::test_a_rank_that_dies_takes_the_engine_with_it") == module


def test_a_module_under_a_conftest_with_a_module_fixture_is_one_unit() -> None:
    module = "tests/learner/test_optimizer.py"  # tests/learner/conftest.py declares tp1_world for the module
    assert _scope(f"{module}::test_x[a-b]") == module


def test_any_other_test_is_a_unit_of_its_own() -> None:
    nodeid = "tests/orchestrate/test_learning.py::test_learning"
    assert _scope(nodeid) == nodeid
