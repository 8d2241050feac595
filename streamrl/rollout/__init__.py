"""Rollout engines: the prompt stream, the vLLM engine with its weight-loading extension and the engine
actor's generation loop. Public API below."""

from streamrl.api import exports

__all__, __getattr__ = exports(__name__, {"RolloutWorker": "worker", "load_prompt_file": "prompts"})
