"""GRPO against TRL 1.16, the figures tests/test_grpo.py bounds: for each variant (loss type, beta,
mask_truncated_completions) and layout, meshtrain's learning step on TRL's recorded completions: the iteration-1
gradient norm and the iteration-2 loss, kl and clip_ratio/region_mean beside TRL's, and the largest relative gap.
    .venv/bin/python scripts/bench/grpo_figures.py [variant ...]  (from the repo root)"""
import sys
sys.path.insert(0, "tests")
import conftest  # noqa: F401,E402  (8 devices)
import numpy as np  # noqa: E402
from test_grpo import FIX, ONE, VARIANTS, ZERO3, learnt  # noqa: E402

for variant in sys.argv[1:] or VARIANTS:
    for name, mesh in (("1 device", ONE), ("(2,1,4) ZeRO-3", ZERO3)):
        f = np.load(FIX / f"{variant}.npz")
        m1, m2, gaps = learnt(variant, mesh)
        pairs = {"grad_norm@1": (float(m1["grad_norm"]), float(f["grad_norm"])),
                 "loss@2": (float(m2["loss"]), float(f["log2_loss"])),
                 "clip_ratio/region_mean@2": (float(m2["clip_ratio/region_mean"]),
                                              float(f["log2_clip_ratio/region_mean"]))}
        if "log2_kl" in f.files:
            pairs["kl@2"] = (float(m2["aux/kl"]), float(f["log2_kl"]))
        gap = max(abs(a - b) / max(abs(b), 1e-6) for a, b in pairs.values())
        print(f"{variant} {name}: " + ", ".join(f"{k} {a:.7g} vs {b:.7g}" for k, (a, b) in pairs.items())
              + f" | largest relative gap {gap:.1e}; old/ref log-probabilities {gaps['old_gap']:.1e}/"
              f"{gaps['ref_gap']:.1e}")
