"""Agents: the LLM client, the base agent, the analyst, the env-builder and the verifier."""
