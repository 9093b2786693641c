"""A figure of the loss-mean issue's closing note, printed from the tests' own helpers (run from the repo root)."""
import sys; sys.path.insert(0, "tests")
import conftest  # noqa: F401  (8 devices)
import trainer.step
from models.batch import counted, mean_of
import test_loss_mean as t
name = sys.argv[1]
(data, _, _), ov, _ = t.LAYOUTS[name]
micro = int(next((o.split("=")[1] for o in ov if o.startswith("train.microbatches")), 1))
w = t.uneven_weights(16, 32)
t._reference_of(name)  # the 1-device reference, unpatched
own = trainer.step.objective


def mean_of_means(c, p, b, scale, **kw):  # this group's loss sum / its own counted tokens x the mean group's
    value, parts = own(c, p, b, scale, **kw)
    f = mean_of(w.sum() / (data * micro), counted(b))
    return value * f, {**parts, "loss": parts["loss"] * f}


trainer.step.objective = mean_of_means
t.trained.cache_clear()
try:
    t.test_every_layout_takes_one_mean_over_counted_tokens(name)
    print("PASSED (patch not seen)")
except AssertionError as e:
    import traceback; print("FAILED:", repr(e)[:600]); traceback.print_exc(limit=-1)
