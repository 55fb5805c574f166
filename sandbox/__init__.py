"""Docker sandbox: engine, offline-built image, hardened containers and sessions."""
