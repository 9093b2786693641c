"""A user's `run.plugins` module written against module names that have since moved (trainer/__init__.py MOVED):
trainer.run.goodput (now trainer.run.goodput_record) and trainer.run.guard (now trainer.run.on_nan); and models.moe (now
models.families.moe), as a family module written for 6e003ec imports it."""
from models.moe import MoEConfig
from trainer.run.goodput import GoodputRecord
from trainer.run.guard import MAX_ROLLBACKS


class LastWords(GoodputRecord):
    """Goodput's record, with the guard's rollback limit beside it."""
    limit = MAX_ROLLBACKS
    reads = MoEConfig
