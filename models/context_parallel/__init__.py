"""Context parallelism in the model: each row's tokens split over the `context` mesh axis. `gather`: the token
order, the plan, and the all-gather and all-to-all attention; `ring`: ring attention (K/V blocks passed by
ppermute). Not to be confused with trainer/run/context.py, the run's context object."""
