"""Data: token sources, the batch of step s, `meshtrain prepare`, and a run's feed."""
