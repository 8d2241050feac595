"""Config files: read a YAML file, apply dotted command-line overrides, validate into a `Config` (errors name the
key), and write the resolved config to the run directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from streamrl.config.layouts import LayoutError, apply_layout
from streamrl.config.sections import Config


class ConfigError(ValueError):
    """A config that cannot run; the message names the offending key."""


def _format_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        if err["type"] == "value_error":  # cross-field checks already name their key
            lines.append(str(err["ctx"]["error"]))
            continue
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key")
        else:
            lines.append(f"{key}: {err['msg']} (got {err['input']!r})")
    return "; ".join(lines)


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (so `3`, `true`, `[1,2]` are typed)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key.sub=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r}: empty key segment")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(raw)


def build_config(tree: dict[str, Any]) -> Config:
    """Validate a nested dict into a Config; raise ConfigError naming every bad key."""
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config, merge the row of its layout table that `cluster.gpus` picks (`streamrl.config.layouts`),
    apply dotted overrides (they win over the row), validate."""
    text = Path(path).read_text()
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    chosen: dict[str, Any] = {"cluster": dict(tree.get("cluster") or {})}
    for override in overrides:
        if override.split("=", 1)[0].strip() == "cluster.gpus":
            apply_override(chosen, override)
    try:
        tree = apply_layout(tree, chosen["cluster"].get("gpus"))
    except LayoutError as exc:
        raise ConfigError(str(exc)) from None
    for override in overrides:
        apply_override(tree, override)
    return build_config(tree)


def save_resolved(config: Config, run_dir: Path) -> Path:
    """Write the fully resolved config (defaults filled in) to `run_dir/config.yaml`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.yaml"
    out.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return out
