"""A HuggingFace checkpoint directory's tensors, read one at a time when asked for.

Contract: `CheckpointTensors(path)` is a read-only mapping from HF tensor name to CPU tensor over every
`*.safetensors` shard of `path` (the names come from `model.safetensors.index.json` when present, else from each
shard's header); a directory without shards, a shard that is not one or an index that names missing shards raises
naming the file. A tensor is read from its memory-mapped shard when it is looked up and not kept, so a learner rank
that converts only the tensors of its own pipeline stage, tensor-parallel slice and experts
(`convert.hf_to_megatron`) holds at most the tensors of the one parameter it is building besides its own share —
never the whole checkpoint (about 470 GB for Qwen3-235B).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

from safetensors import safe_open
from torch import Tensor

INDEX = "model.safetensors.index.json"


class CheckpointTensors(Mapping[str, Tensor]):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"model.path: no *.safetensors files in {self.path}")
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text()).get("weight_map")
            except (ValueError, AttributeError) as exc:
                raise ValueError(f"{index}: not a JSON object ({exc})") from None
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no 'weight_map' object")
            self._file_of = {name: self.path / file for name, file in weight_map.items()}
        else:
            self._file_of = {}
            for file in files:
                try:
                    with safe_open(file, framework="pt") as shard:
                        self._file_of.update(dict.fromkeys(shard.keys(), file))
                except Exception as exc:  # safetensors' own error type (a bad header, a cut file)
                    raise ValueError(f"{file}: not a safetensors file ({exc})") from None
        missing = {file for file in self._file_of.values() if not file.is_file()}
        if missing:
            raise FileNotFoundError(f"{index}: names shards that are not there: {sorted(map(str, missing))}")

    def __getitem__(self, name: str) -> Tensor:
        file = self._file_of[name]  # KeyError for a name the checkpoint lacks, as a dict
        with safe_open(file, framework="pt", device="cpu") as shard:
            return shard.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of
