"""Queue fixtures: `payload_path` runs a test once with groups inside their stream entries, once with them apart."""

import pytest

from streamrl.queue import stream


@pytest.fixture(params=["inline", "apart"])
def payload_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """"inline": every test group travels inside its entry (they are small); "apart": every one is SET apart."""
    if request.param == "apart":
        monkeypatch.setattr(stream, "INLINE_MAX_BYTES", 0)
    return request.param
