"""How the suite's tests are handed to pytest-xdist's workers under `--dist loadscope` (as CI runs it): a test module
whose tests share a module-scoped fixture (its own, or one of a conftest.py above it) is one unit of work, so that the
fixture is built once; every other test is a unit of its own, so both workers share the whole-job tests and the suite
ends on short tests (tests/conftest.py orders them; `--no-loadscope-reorder` keeps that order).

xdist's own `--dist loadgroup` would do this from markers set at collection, but it renames the test ids through an
attribute that pytest 9 no longer reads, so it groups nothing here; and xdist's default load scheduling, one test at
a time, built such a fixture again for each test of its module (a data-parallel engine: ~60 s under CI's load, three
times). The controller process that schedules does not collect tests, so a module's fixtures are read from its
source: a fixture declared with `scope="module"` there or in a conftest.py between it and tests/."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

_TESTS = Path(__file__).parent
_MODULE_SCOPE = 'scope="module"'


@cache
def _shares_a_module_fixture(module: str) -> bool:
    """Whether the test module at `module` (a path relative to the project root) or a conftest.py above it, up to
    tests/, declares a module-scoped fixture."""
    path = _TESTS.parent / module
    sources = [path] + [d / "conftest.py" for d in path.parents if d.is_relative_to(_TESTS)]
    return any(_MODULE_SCOPE in source.read_text() for source in sources if source.is_file())


class SharedFixtureScheduling(LoadScopeScheduling):
    """LoadScopeScheduling whose scope is the module for modules sharing a module-scoped fixture, else the test."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return module if _shares_a_module_fixture(module) else nodeid
