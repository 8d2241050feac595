"""The base of every config section: unknown keys are errors, and a section is immutable once validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
