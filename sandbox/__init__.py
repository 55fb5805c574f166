"""Sandboxes for model-written environments: the Docker backend (hardened containers, offline-built image),
the subprocess backend, host-side contract checks, the code that runs inside (image/) and library envs (envs/)."""
