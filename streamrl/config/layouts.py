"""Layout tables: a config may hold `layouts`, one row per GPU count, and `cluster.gpus` picks the row.

Contract: `apply_layout(tree, gpus)` takes a config tree as read from YAML (before the command line's overrides)
and the chosen GPU count. Without a `layouts` key it returns the tree unchanged. With one, the row of `gpus` is
merged into the tree and the table itself is dropped: the row's `nodes` becomes `cluster.nodes` (and
`cluster.gpus_per_node` is `gpus / nodes`), its `learner`, `optimizer` and `rollout` mappings override the same
keys of those sections (the file's other keys stay). The caller applies the command line's overrides afterwards, so
they win over the row. An unset `cluster.gpus`, or a count with no row, is a `ConfigError` that lists the rows; a
malformed row is one that names its key (`layouts.96.learner: ...`). The merged values are validated with the rest
of the config (`streamrl.config.sections.Config`), which also checks that the row's GPUs add up to `cluster.gpus`.
"""

from __future__ import annotations

from typing import Any

ROW_SECTIONS = ("learner", "optimizer", "rollout")


class LayoutError(ValueError):
    """A layout table or choice that cannot be applied; the message names the key."""


def _rows(layouts: Any) -> dict[int, dict[str, Any]]:
    if not isinstance(layouts, dict) or not layouts:
        raise LayoutError("layouts: expected a mapping of GPU counts to layout rows")
    rows = {}
    for key, row in layouts.items():
        if not isinstance(key, int) or isinstance(key, bool) or key < 1:
            raise LayoutError(f"layouts.{key}: a row's key is its GPU count, a positive integer")
        if not isinstance(row, dict):
            raise LayoutError(f"layouts.{key}: expected a mapping with nodes, learner, optimizer, rollout")
        unknown = set(row) - {"nodes", *ROW_SECTIONS}
        if unknown:
            raise LayoutError(f"layouts.{key}.{sorted(unknown)[0]}: unknown key (nodes, learner, optimizer, rollout)")
        nodes = row.get("nodes", 1)
        if not isinstance(nodes, int) or nodes < 1 or key % nodes:
            raise LayoutError(f"layouts.{key}.nodes: {nodes!r} must be a positive integer that divides {key} GPUs")
        for section in ROW_SECTIONS:
            if not isinstance(row.get(section, {}), dict):
                raise LayoutError(f"layouts.{key}.{section}: expected a mapping of {section}.* keys")
        rows[key] = row
    return rows


def describe_rows(layouts: Any) -> str:
    """One line per row: `96 GPUs (12 nodes): learner TP 8 PP 12 EP 8 ...`, for error messages and `plan`."""
    lines = []
    for gpus, row in sorted(_rows(layouts).items()):
        learner = row.get("learner", {})
        sizes = " ".join(
            f"{short} {learner[key]}"
            for key, short in (
                ("tensor_parallel", "TP"),
                ("pipeline_parallel", "PP"),
                ("expert_parallel", "EP"),
                ("context_parallel", "CP"),
                ("data_parallel", "DP"),
            )
            if key in learner
        )
        nodes = row.get("nodes", 1)
        lines.append(f"{gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''}): learner {sizes or 'default'}")
    return "\n".join(lines)


def apply_layout(tree: dict[str, Any], gpus: Any) -> dict[str, Any]:
    """The tree with the row of `gpus` merged in (see the module docstring)."""
    if "layouts" not in tree:
        return tree
    tree = dict(tree)
    rows = _rows(tree.pop("layouts"))
    counts = ", ".join(str(count) for count in sorted(rows))
    if gpus is None:
        raise LayoutError(f"cluster.gpus: this config has layouts for {counts} GPUs; choose one (cluster.gpus=N)")
    if gpus not in rows:
        raise LayoutError(f"cluster.gpus: no layout for {gpus} GPUs; the rows are:\n{describe_rows(rows)}")
    row = rows[gpus]
    nodes = row.get("nodes", 1)
    tree["cluster"] = {**tree.get("cluster", {}), "gpus": gpus, "nodes": nodes, "gpus_per_node": gpus // nodes}
    for section in ROW_SECTIONS:
        if section in row:
            tree[section] = {**tree.get(section, {}), **row[section]}
    return tree
