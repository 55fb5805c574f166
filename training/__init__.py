"""Model backends (embedded models, llama.cpp server), GRPO training and the MoE composer."""
