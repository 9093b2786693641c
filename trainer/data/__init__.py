"""Data: token sources, the batch of step s (a mixture's too: which source each row draws from), `meshtrain prepare`,
and a run's feed."""
