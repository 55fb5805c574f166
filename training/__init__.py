"""Training: GRPO of one LoRA per capability (and on the target, the baseline), the MoE's gate training
and the composition of the adapters (router, MoE). Models are loaded and decoded by models/."""
