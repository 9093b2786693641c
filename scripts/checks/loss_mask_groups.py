"""A figure of the loss-mean issue's closing note, printed from the tests' own helpers (run from the repo root)."""
import sys; sys.path.insert(0,'tests')
import conftest
import numpy as np, jax, optax
import test_loss_mean as t
from trainer.config import load_config
from trainer.state import init_state, make_setup
from models import forward
cfg = load_config(conftest.TINY + t.BASE + ["mesh.data=1","mesh.stage=1","mesh.model=1"])
s = make_setup(cfg, jax.devices()[:1]); p = t._scaled(jax.tree.map(np.asarray, init_state(s)["params"]))
b = t._batch(s, 0)
ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(forward(s.model, p, b["tokens"]), b["targets"]))
w = t.uneven_weights(16, 32)
print("ce", ce.mean().round(2), ce.std().round(2), "counted", w.sum())
for name,(mesh,ov,_) in t.LAYOUTS.items():
    micro = int(next((o.split("=")[1] for o in ov if o.startswith("train.microbatches")), 1))
    g = t._groups(16, mesh[0], micro)
    sums, counts = (np.bincount(g, x.sum(1), mesh[0]*micro) for x in (ce*w, w))
    means = np.where(counts>0, sums/np.where(counts>0,counts,1), 0)
    gm = sums.sum()/counts.sum()
    print(f"{name}: groups {len(counts)} empty {(counts==0).sum()} mean-of-means off {abs(means.mean()-gm)/gm*100:.1f}%")
