"""Resumable prompt streams as torchdata nodes.

`PromptSource` is a `torchdata.nodes.BaseNode` yielding `Prompt`s forever: the built-in `symbols`
task generates them from (seed, index); a JSONL or Parquet file is replayed epoch after epoch in a
seeded shuffle. Its state (`epoch`, `index`) round-trips through `state_dict()` / `reset(state)`,
so a restarted engine continues where it stopped instead of replaying prompts. `Prompt.token_ids(tokenizer)` is a
prompt under the chat template, as the engine feeds it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdata.nodes import BaseNode

from streamrl.config import TaskConfig


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str  # user message; the engine applies the chat template
    answer: str  # reference the reward compares against
    exact_length: int | None = None  # tokens of each response, end-of-sequence ignored (`task.exact_lengths`)

    def token_ids(self, tokenizer: Any) -> list[int]:
        """The prompt as the engine feeds it: one user message under the tokenizer's chat template."""
        message = [{"role": "user", "content": self.text}]
        return tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True, return_dict=False)


def load_prompt_file(path: Path, prompt_key: str, answer_key: str) -> list[Prompt]:
    """Rows of a JSONL or Parquet file as Prompts; errors name the file, row and key."""
    if not path.is_file():
        raise FileNotFoundError(f"task.prompts_file: no file at {path}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise RuntimeError(f"task.prompts_file: reading {path} needs pyarrow (pip install pyarrow)") from exc
        rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
    else:
        rows = []
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"task.prompts_file: {path}:{line_no} is not JSON ({exc})") from None
    prompts = []
    for row_no, row in enumerate(rows, 1):
        for key in (prompt_key, answer_key):
            if not isinstance(row, dict) or key not in row:
                raise ValueError(f"task.prompts_file: {path} row {row_no} has no key {key!r}")
        prompts.append(Prompt(str(row[prompt_key]), str(row[answer_key])))
    if not prompts:
        raise ValueError(f"task.prompts_file: {path} holds no prompts")
    return prompts


class PromptSource(BaseNode[Prompt]):
    """An endless, seeded, resumable stream of prompts for one engine."""

    def __init__(self, task: TaskConfig, seed: int):
        super().__init__()
        self.task, self.seed = task, seed
        self.prompts = (
            load_prompt_file(task.prompts_file, task.prompt_key, task.answer_key) if task.prompts_file else None
        )
        self.epoch = self.index = 0
        self._order: list[int] = []

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        state = initial_state or {"epoch": 0, "index": 0}
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._shuffle()

    def _shuffle(self) -> None:
        if self.prompts is not None:
            self._order = list(range(len(self.prompts)))
            random.Random(self.seed * 100_003 + self.epoch).shuffle(self._order)

    def next(self) -> Prompt:
        if self.prompts is None:
            return self._symbols_prompt()
        if self.index >= len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._shuffle()
        prompt = self.prompts[self._order[self.index]]
        self.index += 1
        return prompt

    def _symbols_prompt(self) -> Prompt:
        """The symbol four times (a tiny model finds it in the prompt far sooner than a lone character); a long
        prompt (`task.long_fraction`) also names its target, which its answer carries after the symbol."""
        task, rng = self.task, random.Random(self.seed * 1_000_003 + self.index)
        symbol = rng.choice(task.symbols)
        self.index += 1
        if task.long_fraction and rng.random() < task.long_fraction:
            target = task.target_length * task.long_factor
            return Prompt(f"repeat {symbol * 4} x{target}", f"{symbol}{target}", target if task.exact_lengths else None)
        return Prompt(f"repeat {symbol * 4}", symbol, task.target_length if task.exact_lengths else None)

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}
