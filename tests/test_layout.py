"""The package's shape: stages talk through each other's public API only, and files stay small.

A stage is a sub-package of `streamrl` (rollout, queue, batching, learner, ...). Its public API is the `__all__` of
its `__init__` (`streamrl.api.exports`); everything else in it is the stage's own. A module may import its own
stage freely, the shared modules (`types`, `config`, `net`, `api`) and other stages' API names
(`from streamrl.queue import TrajectoryConsumer`), never another stage's modules (`streamrl.queue.stream`).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "streamrl"
SHARED = {"types", "config", "net", "api", "logs"}  # modules every stage may import
MAX_LINES = 400
STAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())


def _streamrl_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of every `streamrl` import in the file, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "streamrl"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "streamrl":
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return found


def _stage_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def test_every_stage_declares_its_api() -> None:
    for stage in STAGES:
        package = importlib.import_module(f"streamrl.{stage}")
        assert package.__all__, f"streamrl.{stage} exports nothing"


def test_no_stage_imports_another_stages_modules() -> None:
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = _stage_of(path)
        for line, module, names in _streamrl_imports(path):
            parts = module.split(".")
            if len(parts) == 1:  # `from streamrl import config`: a shared module by name
                bad = [n for n in names if n not in SHARED]
                if bad:
                    violations.append(f"{path}:{line}: from streamrl import {bad}")
                continue
            target = parts[1]
            if target in SHARED or target == own:
                continue
            if len(parts) > 2:
                violations.append(f"{path}:{line}: {module} is internal to streamrl.{target}")
                continue
            api = importlib.import_module(module).__all__
            violations += [f"{path}:{line}: {module}.{n} is not in its __all__" for n in names if n not in api]
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("stage", STAGES)
def test_every_api_name_resolves(stage: str) -> None:
    package = importlib.import_module(f"streamrl.{stage}")
    for name in package.__all__:
        assert getattr(package, name) is not None


def test_files_stay_small() -> None:
    big = {str(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"over {MAX_LINES} lines: {big}"


def test_the_learner_worker_imports_few_streamrl_modules() -> None:
    modules = {module for _, module, _ in _streamrl_imports(PACKAGE / "learner" / "worker.py")}
    assert len(modules) <= 12, sorted(modules)
