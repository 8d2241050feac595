"""Rewards from outside the package: a user's function named by `task.reward`, or an HTTP reward service at
`task.reward_url`.

A function spec is "package.module:function" or "path/to/file.py:function". The function takes
`(prompt, response, metadata)` and returns a float or a dict with a "reward" float (other keys are ignored);
with `task.reward_batch` it takes the lists of one group's prompts, responses and metadata and returns one such value
per response. `metadata` holds the prompt's reference `answer` and its `prompt_id`. A service gets a POST of
`{"prompt", "response", "metadata"}` (JSON) and answers `{"reward": float}`; a request is retried
`task.reward_retries` times, each bounded by `task.reward_timeout_s`. A value that is not a finite number is an
error naming the spec.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import urllib.error
import urllib.request
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any


def _parts(spec: str) -> tuple[str, str]:
    """(module or file, function) of a spec."""
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ValueError(f"task.reward: {spec!r} is not 'package.module:function' or 'file.py:function'")
    return module_name, attribute


def check_spec(spec: str) -> None:
    """A spec's form and that its code is there (the file, or the module on the Python path), without running the
    module: the driver refuses a reward no engine could load before any starts (ValueError naming task.reward).
    Whether the module defines the function shows when an engine loads it."""
    module_name, _ = _parts(spec)
    if module_name.endswith(".py"):
        if not Path(module_name).is_file():
            raise ValueError(f"task.reward: no Python file at {module_name}")
        return
    try:
        found = importlib.util.find_spec(module_name)
    except ModuleNotFoundError:  # a missing parent package
        found = None
    if found is None:
        raise ValueError(f"task.reward: no module {module_name!r} on the Python path")


@cache
def load_function(spec: str) -> Callable[..., Any]:
    """The callable of "package.module:function" or "file.py:function" (cached per process)."""
    check_spec(spec)
    module_name, attribute = _parts(spec)
    if module_name.endswith(".py"):
        path = Path(module_name)
        loader_spec = importlib.util.spec_from_file_location(f"streamrl_reward_{path.stem}", path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"task.reward: no Python file at {path}")
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"task.reward: {module_name} has no function {attribute!r}")
    return function


def as_reward(value: Any, source: str) -> float:
    """A reward function's answer as a finite float (a dict answers with its "reward")."""
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{source}: a reward must be a finite number or a dict with one, got {value!r}")
    return float(value)


def call_spec(spec: str, batch: bool, prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
    """One group's rewards from the function `spec` (per response, or one batch call)."""
    function = load_function(spec)
    if batch:
        values = function(prompts, responses, metadata)
        if len(values) != len(responses):
            raise ValueError(f"task.reward: {spec} returned {len(values)} rewards for {len(responses)} responses")
    else:
        values = [function(p, r, m) for p, r, m in zip(prompts, responses, metadata, strict=True)]
    return [as_reward(value, f"task.reward {spec}") for value in values]


def call_service(url: str, timeout_s: float, retries: int, prompt: str, response: str, metadata: dict) -> float:
    """One response's reward from the HTTP service at `url`."""
    body = json.dumps({"prompt": prompt, "response": response, "metadata": metadata}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"}, method="POST")
    for attempt in range(retries + 1):
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                return as_reward(json.loads(reply.read()), f"task.reward_url {url}")
        except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError):
            if attempt == retries:
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")
