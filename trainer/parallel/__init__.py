"""Parallelism: the microbatch split, gradient collectives and their costs, pipeline schedules and their executor, local SGD."""
