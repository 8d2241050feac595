"""Checkpoint bookkeeping without torch: where a run directory's checkpoints live, which one is the latest, and what a
step directory's `meta.json` says (validated, errors naming the file and field). The driver reads it before any
learner starts; `checkpoint.py` writes and loads the checkpoints themselves. `prune_checkpoints(root, keep)` removes
all but the `keep` newest complete checkpoints (never the one `latest` names) and the leftovers of saves that crashed
before it.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

FORMAT = 1
CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"
META = "meta.json"
_DIST = "dist"  # the dist_checkpointing directory inside a step directory
_STEP_DIR = re.compile(r"step_(\d{8})")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class CheckpointMeta:
    format: int  # FORMAT of the writer
    step: int  # driver steps completed when saved
    version: int  # policy version (optimizer steps taken) of the saved weights
    tensor_parallel: int  # layout of the saving job; a loading job may differ
    data_parallel: int
    config_hash: str  # sha256 of the resolved config of the saving job (which run produced it)
    pipeline_parallel: int = 1


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS_DIR


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def read_meta(path: Path) -> CheckpointMeta:
    """Validate and read `path/meta.json`; anything missing or mistyped raises naming the file and field."""
    file = path / META
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (incomplete checkpoint)")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    fields = {
        "format": int,
        "step": int,
        "version": int,
        "tensor_parallel": int,
        "data_parallel": int,
        "config_hash": str,
    }
    for name, kind in fields.items():
        value = raw.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(f"{file}: field {name!r} must be {kind.__name__}, got {value!r}")
    if raw["format"] != FORMAT:
        raise CheckpointError(f"{file}: field 'format' is {raw['format']}, this reader supports {FORMAT}")
    stages = raw.get("pipeline_parallel", 1)
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise CheckpointError(f"{file}: field 'pipeline_parallel' must be a positive int, got {stages!r}")
    if path.name != step_dir(path.parent, raw["step"]).name:
        raise CheckpointError(f"{file}: field 'step' is {raw['step']} but the directory is {path.name}")
    if not (path / _DIST / "metadata.json").is_file():
        raise CheckpointError(f"{path / _DIST / 'metadata.json'}: missing (incomplete checkpoint)")
    return CheckpointMeta(**{name: raw[name] for name in fields}, pipeline_parallel=stages)


def latest_checkpoint(root: Path) -> Path | None:
    """The step directory `root/latest` names (validated), or None when no checkpoint was completed."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not _STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{pointer}: expected a step directory name like step_00000004, got {name!r}")
    read_meta(root / name)
    return root / name


def completed_step(run_dir: Path) -> int:
    """The step of the run directory's latest completed checkpoint (0 when there is none)."""
    latest = latest_checkpoint(checkpoint_root(run_dir))
    return 0 if latest is None else read_meta(latest).step


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Remove every step directory older than the `keep` newest complete ones, and incomplete ones (a save that
    crashed) older than the latest; returns what was removed. `keep` >= 1; the latest is always among those kept."""
    if keep < 1:
        raise ValueError(f"train.keep_checkpoints: prune needs at least 1 to keep, got {keep}")
    latest = latest_checkpoint(root)
    if latest is None:
        return []
    newest = read_meta(latest).step
    complete, removed = [], []
    for path in sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)):
        step = int(_STEP_DIR.fullmatch(path.name).group(1))
        if step > newest:
            continue  # not older than the latest: none is written while this runs (the learner saves in turn)
        try:
            read_meta(path)
            complete.append(path)
        except CheckpointError:
            removed.append(path)  # a crashed save's leftovers
    removed += [path for path in complete[:-keep] if path != latest]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
