"""Benchmark adapters, rollouts, evaluation and reports."""
