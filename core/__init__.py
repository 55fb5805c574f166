"""Types and files below every stage: episodes, trajectories, run records, reward rules, atomic writes,
the cache folder and figures. Imports nothing else of the project."""
