"""A user's `run.plugins` module written against module names that have since moved (trainer/__init__.py MOVED):
trainer.run.goodput (now trainer.run.goodput_record) and trainer.run.guard (now trainer.run.on_nan)."""
from trainer.run.goodput import GoodputRecord
from trainer.run.guard import MAX_ROLLBACKS


class LastWords(GoodputRecord):
    """Goodput's record, with the guard's rollback limit beside it."""
    limit = MAX_ROLLBACKS
