"""A figure of the loss-mean issue's closing note, printed from the tests' own helpers (run from the repo root)."""
import sys; sys.path.insert(0, "tests")
import conftest  # noqa
from test_plan import _plan
from trainer.plan.verify import measure
for m in (1, 4):
    cfg, plan = _plan(["mesh.data=8", "train.zero_stage=1", "train.batch_size=32", f"train.microbatches={m}"])
    got = measure(cfg, grads=False)
    print(m, "HLO data-axis bytes", got.axis_bytes("data"), "gradient all-reduce", got.collectives[("all-reduce", ("data",))], "planner", plan.axis_bytes("data"))
