"""How far two chained GRPO iterations on a Mixtral (tests/test_grpo.py's MoE layout check) move under a 2-ulp change
of the starting weights, beside how far the layout moves them: why that test starts each iteration from the same
weights on both layouts. Prints each iteration's relative grad_norm difference: (2,1,4) ZeRO-3 with the experts split
against one device, and one device from its weights times (1 + 3e-7 x a standard normal) against one device.
Run from the repo root."""
import sys

sys.path.insert(0, "tests")
import conftest  # noqa: F401,E402  (8 devices)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import test_grpo as t  # noqa: E402
import trainer.ckpt.params as params_module  # noqa: E402

MIX = t.Path("tests/fixtures/hf/mixtral_e4k2_f32")
SPLIT = ("mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3", "train.expert_parallel=true")


def chained(mesh) -> list[float]:
    """Each of two iterations' grad_norm, the second from the first's parameters on the same layout."""
    m1, p1 = t._synthetic(MIX, mesh)
    m2, _ = t._synthetic(MIX, mesh, p1)
    return [m1["grad_norm"], m2["grad_norm"]]


def perturbed(s, folder):
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x) * (1 + 3e-7 * rng.standard_normal(x.shape)
                                                                  ).astype(x.dtype), x.sharding), loaded(s, folder))


one, split = chained(t.ONE), chained(SPLIT)
loaded, params_module.init_params = params_module.init_params, perturbed
noisy = chained(t.ONE)
for i in range(2):
    print(f"iteration {i + 1}: grad_norm {one[i]:.6f}; the layout {abs(split[i] - one[i]) / one[i]:.1e}, "
          f"2 ulp on the weights {abs(noisy[i] - one[i]) / one[i]:.1e}")
