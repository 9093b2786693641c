"""Objectives: what the head's outputs and the batch give the step to minimise. `loss`: next-token cross-entropy
(whole or tiled over tokens) and the objective composed from the token loss, the aux terms and DPO; `dpo`: Direct
Preference Optimization as TRL defines it."""
