"""Every way a model is reached: `LLMConfig` and the one client (llm.py), what replies hold (chat.py), the
servers the project starts in one registry (endpoints.py: llama.cpp, the engine's), embedded weights,
GGUF LoRA, transformers loading, the batching engine, stacked projections and JSON-schema grammar."""
