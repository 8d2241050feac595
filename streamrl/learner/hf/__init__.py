"""HuggingFace ⇄ Megatron: name and layout conversion, loading HF checkpoints into learner chunks, streaming
HF-named weights out, export."""
