"""One process of tests/test_moe_hf_expert_parallel.py's multi-process import: joins the run named by the dist.*
keys, imports the HF folder of model.init_from into the layout of the other keys, and writes to OUT (JSON) every
byte of each .safetensors file it read and the experts its own devices hold.

    python tests/hf_ranges_child.py OUT key=value ...

The bytes are recorded where the import reads tensors, `Tensor.array` (trainer/ckpt/safetensors.py: a memory map,
so a byte is read only when a slice of it is taken): the map is wrapped in an array whose indexing records the file
offset of every element of the slice it returns, from the slice's own data pointer and strides."""
import json
import sys

import numpy as np

READ: dict[str, set] = {}


class Recording(np.ndarray):
    """A view of a tensor's memory map that records the bytes each indexing returns (reshape keeps the class)."""

    def __array_finalize__(self, obj):
        self.origin = getattr(obj, "origin", None)

    def __getitem__(self, key):
        got = np.asarray(self)[key]
        file, base, start = self.origin
        assert np.shares_memory(got, np.asarray(self)), "a slice that copies: its bytes cannot be told"
        first = got.__array_interface__["data"][0] - base + start
        idx = np.indices(got.shape).reshape(got.ndim, -1)
        offsets = first + (np.asarray(got.strides)[:, None] * idx).sum(axis=0)
        READ.setdefault(file, set()).update(int(o + b) for o in offsets for b in range(got.itemsize))
        return got


def runs(offsets: set) -> list:
    """Sorted bytes as [first, past-the-end) runs."""
    out = []
    for o in sorted(offsets):
        if out and out[-1][1] == o:
            out[-1][1] = o + 1
        else:
            out.append([o, o + 1])
    return out


def main(out: str, overrides: list):
    from trainer.ckpt import safetensors as st
    plain = st.Tensor.array

    def array(self):
        a = plain(self)
        r = a.view(Recording)
        r.origin = (str(self.file), a.__array_interface__["data"][0], self.start)
        return r
    st.Tensor.array = array

    import jax
    from trainer import load_config, resolve
    from trainer.ckpt.params import init_params
    from trainer.run.distributed import initialize
    from trainer.state import make_setup
    cfg = resolve(load_config(overrides))
    assert initialize(cfg.dist)
    s = make_setup(cfg, jax.devices())
    params = init_params(s, cfg.model.init_from)
    held = {}
    for k in ("expert_gate", "expert_up", "expert_down"):
        a = params["layers"][k]
        held[k] = sorted({e for sh in a.addressable_shards for e in range(a.shape[1])[sh.index[1]]})
    with open(out, "w") as f:
        json.dump({"process": jax.process_index(), "held": held,
                   "read": {file: runs(b) for file, b in READ.items()}}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
