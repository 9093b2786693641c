"""The CPU cost of data.document_mask=true against false, on the bench shape, in one process.

  python scripts/bench/document_mask_cost.py [--steps 20] [--rounds 5] [-- key=value ...]

Both train steps (scripts/bench/bench.yaml plus any key=value, data.source=builtin) are compiled in this
process and run in alternating blocks of --steps steps on the same batch (its fields from the documents
of builtin: windows cross file boundaries), so that both see the same machine at the same moments; the
per-round ratio of their step times is the figure (absolute times hold only on a quiet machine).
"""
from __future__ import annotations

import sys
from pathlib import Path

from alternate import alternate, alternating_args

ROOT = Path(__file__).resolve().parents[2]


def main():
    a, extra = alternating_args(__doc__)
    sys.path.insert(0, str(ROOT))
    import jax
    from trainer.config import load_config
    from trainer.data.batches import Batches, load_corpus
    from trainer.state import init_state, make_setup
    from trainer.step import jit_train_step
    steps, states, batch = {}, {}, None
    for mask in ("false", "true"):
        cfg = load_config([str(ROOT / "scripts/bench/bench.yaml"), *extra, "data.source=builtin",
                           f"data.document_mask={mask}", "run.progress=false"])
        s = make_setup(cfg, jax.devices()[:1])
        if batch is None:  # the fields of documents: the same batch for both (false reads tokens and targets)
            batch = jax.device_put(Batches(load_corpus("builtin"), 0, cfg.train.batch_size, s.model.seq_len,
                                           s.model.vocab_size, document_mask=True).global_train(0))
        steps[mask], states[mask] = jit_train_step(s), init_state(s)

    alternate(steps, states, {m: batch for m in steps}, a.steps, a.rounds, ("false", "true"),
              label=lambda m: f"document_mask={m}")

if __name__ == "__main__":
    main()
