"""The Megatron model parts: GPT chunks from an HF config (attention, MLA, MoE with grouped-GEMM experts, fused
kernels), vocabulary-parallel log-probs, layout checks and router statistics."""
