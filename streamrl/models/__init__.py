"""Random HuggingFace-format models for tests and first runs (no hub needed). Public API below."""

from streamrl.api import exports

__all__, __getattr__ = exports(
    __name__, {"ARCHS": "tiny", "PRESETS": "tiny", "tiny_model_config": "tiny", "write_tiny_model": "tiny"}
)
