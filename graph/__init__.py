"""LangGraph pipeline, run state and the `trace-rl` command line."""
