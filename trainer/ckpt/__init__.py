"""Checkpoints: asynchronous Orbax saves, validated restores onto any mesh, preemption, inspect and export."""
