"""gpt-oss against transformers, the figures the tests bound: each fixture's largest logit difference (short and
long prompt) on 1 device and (2,1,4) ZeRO-3 with the experts split, and the lr-0 step's loss and balancing term.
    .venv/bin/python scripts/bench/gpt_oss_figures.py  (from the repo root)"""
import sys
sys.path.insert(0, "tests")
import conftest  # noqa: F401,E402  (8 devices)
import jax  # noqa: E402
import numpy as np  # noqa: E402
from test_deepseek import _both_prompts  # noqa: E402
from test_gpt_oss import EP, FIX, ONE, _loaded  # noqa: E402
for name, mesh in (("gpt_oss_f32", ONE), ("gpt_oss_f32", EP), ("gpt_oss_mxfp4", ONE)):
    s, params = _loaded(name, mesh)
    short, long = _both_prompts(s, params, np.load(FIX / name / "reference.npz"))
    print(f"{name} {'1dev' if mesh is ONE else '(2,1,4) zero3 EP'}: short {short:.2e} long {long:.2e}")
from conftest import fresh_state  # noqa: E402
from models.batch import from_windows  # noqa: E402
from trainer.step import jit_train_step  # noqa: E402
ref = np.load(FIX / "gpt_oss_f32" / "reference.npz")
s, params = _loaded("gpt_oss_f32", ONE, "train.lr=0", f"model.router_aux_loss={float(ref['aux_coef'])}", T=23)
with jax.set_mesh(s.mesh):
    _, m = jit_train_step(s)({**fresh_state(s), "params": params},
                             jax.device_put(from_windows(ref["loss_tokens"]), s.batch_sharding()))
print(f"lr0: loss {float(m['loss']):.7f} vs {float(ref['loss']):.7f} ({abs(float(m['loss'])-float(ref['loss'])):.1e});"
      f" balance {float(m['aux/load_balance']):.7f} vs {float(ref['aux_loss']):.7f} "
      f"({abs(float(m['aux/load_balance'])-float(ref['aux_loss'])):.1e})")
print("fixture: margin", float(ref["margin"]), "clamps", ref["clamps"], "sink effect", float(ref["sink_effect"]))
