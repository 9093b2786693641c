"""Block-FP8 weights (DeepSeek's published form: float8 e4m3 values, one float32 factor per block of
quantization_config.weight_block_size, blocks cut short at the bottom and right edges) imported as float32.

A float32 fixture's projections quantized here in blocks of 24 x 40 (every weight, 32 to 96 wide, has blocks cut
short at an edge); its import, sharded over (2,1,2) ZeRO-3 so that each device reads a slice, against the
import of the same folder with each weight written out as a NumPy reference computed block by block: bit for bit."""
import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import SGD, TINY
from hf_check import FIX, read_folder, write_st

from trainer.errors import UserError

BLOCK = (24, 40)
E4M3_MAX = 448.0  # float8 e4m3's largest finite value


def _quantized(w: np.ndarray, BLOCK=BLOCK):
    """(float8 values, float32 factors) of w in BLOCK-sized blocks, each scaled to e4m3's range (as DeepSeek's)."""
    grid = tuple(-(-n // b) for n, b in zip(w.shape, BLOCK))
    s = np.empty(grid, np.float32)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            blk = w[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            s[i, j] = max(float(np.abs(blk).max()), 1e-12) / E4M3_MAX
            q[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = (blk / s[i, j]).astype(q.dtype)
    return q, s


def _reference(q: np.ndarray, s: np.ndarray, BLOCK=BLOCK) -> np.ndarray:
    """The float32 weight: each element its float8 value times its block's factor, element by element."""
    out = np.empty(q.shape, np.float32)
    for r in range(q.shape[0]):
        for c in range(q.shape[1]):
            out[r, c] = np.float32(q[r, c]) * s[r // BLOCK[0], c // BLOCK[1]]
    return out


def _folders(tmp_path, src="gqa_untied_f32", block=BLOCK):
    """(the FP8 folder, the folder of its NumPy reference weights), from a float32 fixture."""
    fp8, ref = tmp_path / "fp8", tmp_path / "ref"
    for d in (fp8, ref):
        shutil.copytree(FIX / src, d)
        (d / "model.safetensors").unlink()
    q_tensors, r_tensors = {}, {}
    for name, (_, w) in read_folder(FIX / src).items():
        if name.endswith("proj.weight"):
            q, s = _quantized(w, block)
            q_tensors.update({name: q, name + "_scale_inv": s})
            r_tensors[name] = _reference(q, s, block)
        else:
            q_tensors[name] = r_tensors[name] = w
    write_st(fp8 / "model.safetensors", q_tensors)
    write_st(ref / "model.safetensors", r_tensors)
    c = json.loads((fp8 / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": list(block)}
    (fp8 / "config.json").write_text(json.dumps(c))
    return fp8, ref


def _imported(folder):
    from trainer import load_config, resolve
    from trainer.ckpt.params import init_params
    from trainer.state import make_setup
    cfg = resolve(load_config(TINY + SGD + ["train.batch_size=4", "mesh.data=2", "mesh.model=2", "train.zero_stage=3",
                                            f"model.init_from={folder}", "model.seq_len=23"]))
    return jax.device_get(init_params(make_setup(cfg, jax.devices()[:4]), folder))


@pytest.mark.parametrize("src,block", [("gqa_untied_f32", BLOCK), ("deepseek_v3_f32", (16, 16))])
def test_fp8_weights_import_as_the_block_reference_bit_for_bit(tmp_path, src, block):
    """The Llama fixture in blocks of 24 x 40; the DeepSeek-V3 one (tests/fixtures/hf/deepseek_v3_f32: latent
    attention's projections, the dense MLPs, every expert and the shared expert) in blocks of 16 x 16, every
    projection 24 to 112 wide and kv_a_proj_with_mqa's 24 rows, q_b_proj's 24 columns cut short at an edge."""
    fp8, ref = _folders(tmp_path, src, block)
    got, want = _imported(fp8), _imported(ref)
    flat_got, flat_want = jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)
    for (path, a), b in zip(flat_got, flat_want):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)
    # the quantization moved the weights (the test compares more than the float32 fixture with itself)
    orig = read_folder(FIX / "gqa_untied_f32")["model.layers.0.self_attn.q_proj.weight"][1]
    assert not np.array_equal(_reference(*_quantized(orig)), orig)


def test_fp8_without_its_factors_or_with_another_grid_is_one_line(tmp_path):
    from trainer.ckpt.hf import index
    fp8, _ = _folders(tmp_path)
    tensors = {k: a for k, (_, a) in read_folder(fp8).items()}
    name = "model.layers.0.mlp.down_proj.weight"
    cases = {"missing": {k: a for k, a in tensors.items() if k != name + "_scale_inv"},
             "grid": {**tensors, name + "_scale_inv": tensors[name + "_scale_inv"][:, :1].copy()}}
    for case, t in cases.items():
        write_st(fp8 / "model.safetensors", t)
        with pytest.raises(UserError) as e:
            index(fp8)
        assert "\n" not in str(e.value) and name in str(e.value), (case, str(e.value))
    c = json.loads((fp8 / "config.json").read_text())
    del c["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(c))
    write_st(fp8 / "model.safetensors", tensors)
    with pytest.raises(UserError, match="no quantization_config"):
        index(fp8)
