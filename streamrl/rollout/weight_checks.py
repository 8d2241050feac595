"""The checks a received weight version passes before it reaches an engine's model.

Contract: a version is HF-named `(name, tensor)` pairs. `checkpoint_shapes(model_dir)` reads the names and shapes of
the engine's own safetensors checkpoint (headers only). `validate_version` checks a whole version at once;
`validate_bucket` checks one bucket of it as it arrives (unknown name, wrong shape, not floating point, a name twice)
and `validate_complete` the set of names at its end. Each raises ValueError naming the tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Return {HF tensor name: shape} of the safetensors checkpoint in `model_dir` (headers only)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model path {str(model_dir)!r}: no *.safetensors files to validate weight names against")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def validate_version(
    tensors: list[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]], optional: set[str]
) -> None:
    """Raise ValueError unless `tensors` is exactly one full, well-shaped copy of the checkpoint."""
    seen: set[str] = set()
    validate_bucket(tensors, shapes, seen)
    validate_complete(shapes, optional, seen)


def validate_bucket(
    tensors: list[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]], seen: set[str]
) -> None:
    """Raise ValueError on a tensor the checkpoint lacks, of another shape, not floating point, or already in `seen`
    (the names of this version so far, which this extends)."""
    for name, tensor in tensors:
        if name not in shapes:
            raise ValueError(f"weight bucket: unknown tensor {name!r} (not a parameter of the model checkpoint)")
        if name in seen:
            raise ValueError(f"weight bucket: tensor {name!r} appears more than once in one version")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(
                f"weight bucket: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {shapes[name]}"
            )
        if not tensor.is_floating_point():
            raise ValueError(f"weight bucket: tensor {name!r} has non-float dtype {tensor.dtype}")
        seen.add(name)


def validate_complete(shapes: dict[str, tuple[int, ...]], optional: set[str], seen: set[str]) -> None:
    """Raise ValueError unless the names `seen` cover every checkpoint tensor but the `optional` ones."""
    missing = sorted(set(shapes) - optional - seen)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        raise ValueError(f"weight bucket: version is incomplete, {len(missing)} tensors missing (e.g. {shown})")
