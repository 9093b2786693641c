"""Objectives: what the head's outputs and the batch give the step to minimise. `cross_entropy`: the next-token
cross-entropy, whole or tiled over tokens, and the one place that decides which; `objective`: the objective composed
once (token loss, aux terms, DPO) for the plain and the pipelined step, its scales, counts and metrics; `dpo`: Direct
Preference Optimization as TRL defines it."""
