"""`benchmarks/async_stability.py`'s variants: a name and the overrides that make it, refused when malformed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks import each other

from async_stability import DEFAULT_VARIANTS, parse_variant  # noqa: E402

from streamrl.config import load_config  # noqa: E402


def test_a_variant_is_a_name_and_its_overrides() -> None:
    assert parse_variant("async-mis=loss.policy_loss=mis,optimizer.lr=5e-4") == (
        "async-mis",
        ["loss.policy_loss=mis", "optimizer.lr=5e-4"],
    )
    assert parse_variant("async=") == ("async", [])
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=KEY=VALUE"):
        parse_variant("async")


def test_the_default_variants_are_valid_configs() -> None:
    config_path = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    modes = {}
    for text in DEFAULT_VARIANTS:
        name, overrides = parse_variant(text)
        config = load_config(config_path, overrides)
        modes[name] = (config.train.mode, config.loss.policy_loss)
    assert modes == {"sync": ("sync", "tis"), "async": ("async", "tis"), "async-mis": ("async", "mis")}
