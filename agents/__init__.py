"""Agents: the base agent loop, the analyst, the env-builder and the verifier (models: models/)."""
