"""Shared types and IO below every stage: episodes, trajectories, run records, atomic writes,
figures, reward rules, the LLM client, embedded model files and the llama.cpp server."""
