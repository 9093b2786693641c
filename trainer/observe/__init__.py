"""Watching a run: metrics lines, MFU, goodput, profiler traces and plots."""
