"""What the actors of a test's run wrote about errors: their output goes to RUN_DIR/logs (streamrl.logs), and an
actor that died says why only there."""

from __future__ import annotations

import re
from pathlib import Path

_ERROR_LINE = re.compile(r"Traceback|Error|error:|ending so that|Fatal|Segmentation|core dumped")


def errors_in_run_logs(root: Path, context: int = 12, limit: int = 6000) -> str:
    """The lines from the first error to a few past the last in each actor log under `root` (RUN_DIR/logs/*.log),
    at most the last `limit` characters."""
    parts = []
    for log in sorted(root.rglob("logs/*.log")):
        lines = log.read_text(errors="replace").splitlines()
        hits = [i for i, line in enumerate(lines) if _ERROR_LINE.search(line)]
        if hits:
            start = max(0, hits[0] - 2)
            excerpt = "\n".join(lines[start : hits[-1] + context])
            parts.append(f"--- {log.relative_to(root)} (line {start + 1} on)\n{excerpt}")
    return "\n".join(parts)[-limit:]
