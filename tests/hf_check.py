"""What the Hugging Face tests share: the fixtures (tests/fixtures/hf, made by transformers:
scripts/make_hf_fixture.py), an independent safetensors reader and writer, a fixture imported into a layout, and
the parity checks against transformers' logits and greedy tokens (1 device, ZeRO-3 (2,1,4), the 1F1B
pipeline executor) and the bitwise round trip."""
import functools
import json
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from conftest import SGD, TINY
from models.batch import from_windows

FIX = Path(__file__).parent / "fixtures" / "hf"
DT = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "U8": np.uint8}
# (data, stage, model): ZeRO-3 over data with heads split 4 ways; a pipeline over stage (the 3-layer
# fixture pipelines over 3 stages on 6 devices: 2 stages cannot split 3 layers)
LAYOUTS = {"1dev": ["mesh.data=1", "mesh.stage=1", "mesh.model=1"],
           "zero3_2x1x4": ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3"],
           "pipe_2x2x2": ["mesh.data=2", "mesh.stage=2", "mesh.model=2", "train.microbatches=2",
                          "train.pipeline_schedule=1f1b"]}
PIPE_3_LAYERS = ["mesh.data=2", "mesh.stage=3", "mesh.model=1", "train.microbatches=3", "train.batch_size=6",
                 "train.pipeline_schedule=1f1b"]


def read_st(path) -> dict:
    """A .safetensors file as {name: (dtype code, array)}, read here independently of trainer code."""
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    return {k: (v["dtype"], np.frombuffer(data[v["data_offsets"][0]:v["data_offsets"][1]], DT[v["dtype"]])
                .reshape(v["shape"])) for k, v in head.items() if k != "__metadata__"}


def read_folder(d) -> dict:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(read_st(f))
    return out


def write_st(path, tensors: dict):
    """{name: array} as a .safetensors file (F32/BF16/F8_E4M3), written here independently of trainer code."""
    head, off, blobs = {}, 0, []
    for k, a in tensors.items():
        code = next(k for k, v in DT.items() if a.dtype == v)
        b = np.ascontiguousarray(a).tobytes()
        head[k] = {"dtype": code, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    raw = json.dumps(head).encode()
    Path(path).write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


@functools.lru_cache(maxsize=None)
def loaded(name, layout, seq_len=23):
    """(setup, params) of a fixture imported into a layout's parameter shardings (seq_len 23: the
    reference tokens are one (2, 24) batch)."""
    from trainer.ckpt.params import init_params
    from trainer import load_config, resolve
    from trainer.state import make_setup
    mesh = PIPE_3_LAYERS if (layout == "pipe_2x2x2" and name == "sharded_f32") else LAYOUTS[layout]
    cfg = resolve(load_config(TINY + SGD + ["train.batch_size=4"] + mesh + [f"model.init_from={FIX / name}",
                                                                            f"model.seq_len={seq_len}"]))
    n = int(np.prod([cfg.mesh.data, cfg.mesh.stage, cfg.mesh.model]))
    s = make_setup(cfg, jax.devices()[:n])
    return s, init_params(s, cfg.model.init_from)


def ref_loss(logits, tokens):
    """Next-token cross-entropy from transformers' logits, in float64."""
    lg = logits[:, :-1].astype(np.float64)
    m = lg.max(-1, keepdims=True)
    logz = (m[..., 0] + np.log(np.exp(lg - m).sum(-1)))
    return float(np.mean(logz - np.take_along_axis(lg, tokens[:, 1:, None], -1)[..., 0]))


def check_parity(name, layout):
    """A fixture's logits (within 1e-4) and greedy tokens (equal) against transformers' from its import into a
    layout; (setup, params, reference)."""
    from models.decode import generate
    from models.transformer import forward
    s, params = loaded(name, layout)
    ref = np.load(FIX / name / "reference.npz")
    with jax.set_mesh(s.mesh):
        got = np.asarray(jax.jit(lambda p, t: forward(s.model, p, t))(params, ref["tokens"]))
        greedy = np.concatenate(list(generate(s.model, params, ref["prompt"], ref["greedy"].shape[1])))
    assert np.abs(got - ref["logits"]).max() < 1e-4
    np.testing.assert_array_equal(greedy, ref["greedy"][0])
    return s, params, ref


def check_pipeline(name, long=False):
    """Through the pipeline executor's 1F1B schedule (the pipeline layout's train step, forward and backward ticks): the
    logits its last stage computes (`step_logits`) for the reference tokens (1e-4) and the step's loss (1e-5),
    and greedy tokens read from those logits one position at a time (the sequence zero-padded to the step's
    length: attention is causal, so the padding changes nothing before it). long: the reference's long prompt
    instead: its last 8 positions' logits and 8 greedy tokens. Returns the setup."""
    from trainer.parallel.pipeline import step_logits
    ref = np.load(FIX / name / "reference.npz")
    prompt, greedy = (ref["long_prompt"], ref["long_greedy"]) if long else (ref["prompt"], ref["greedy"])
    prompt, greedy = list(prompt[0]), greedy[0]
    T = len(prompt) + len(greedy) - 1 if long else ref["tokens"].shape[1] - 1
    s, params = loaded(name, "pipe_2x2x2", T)
    rows = s.cfg.train.batch_size  # a microbatch per data rank and stage fill
    step = jax.jit(lambda p, b: step_logits(s, p, b))

    def run(windows):
        with jax.set_mesh(s.mesh):
            logits, parts = step(params, jax.device_put(from_windows(windows), s.batch_sharding()))
        return np.asarray(logits), parts

    if not long:
        logits, parts = run(np.concatenate([ref["tokens"]] * (rows // 2)))
        for r in range(0, rows, 2):
            assert np.abs(logits[r:r + 2] - ref["logits"][:, :T]).max() < 1e-4, r
        assert abs(float(parts["loss"]) - ref_loss(ref["logits"], ref["tokens"])) < 1e-5
    seq = prompt
    for i in range(len(greedy)):
        w = np.zeros((rows, T + 1), np.int32)
        w[:, :len(seq)] = seq
        logits, _ = run(w)
        if long and i == 0:
            assert np.abs(logits[0, len(seq) - 8:len(seq)] - ref["long_logits"]).max() < 1e-4
        seq = seq + [int(logits[0, len(seq) - 1].argmax())]
    np.testing.assert_array_equal(seq[len(prompt):], greedy)
    return s


def check_both_prompts(name, layout):
    """Parity on the reference tokens and on the long prompt: on 1 device and (2,1,4) the forward on the params as
    imported into the layout and KV-cache decoding; on the pipeline the pipeline executor's own logits. The setup."""
    if layout == "pipe_2x2x2":
        s = check_pipeline(name)
        check_pipeline(name, long=True)
        return s
    s, params, ref = check_parity(name, layout)
    check_long_prompt(s, params, ref)
    return s


def layout_cases(names, default) -> list:
    """pytest params (name, layout) of every fixture on every layout; those not in `default` marked slow."""
    import pytest
    return [pytest.param(n, lay, marks=() if (n, lay) in default else pytest.mark.slow, id=f"{n}-{lay}")
            for n in names for lay in LAYOUTS]


def trainer_script():
    """scripts/make_trained_hf_fixture.py as a module."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import make_trained_hf_fixture
    return make_trained_hf_fixture


def check_long_prompt(s, params, ref, context=512):
    """The reference's long prompt (at least 400 tokens): its last 8 positions' logits (1e-4) and the greedy
    tokens of KV-cache decoding with the model's context, against transformers'."""
    from models.decode import generate
    from models.transformer import forward
    long = ref["long_prompt"]
    assert long.shape[1] >= 400
    with jax.set_mesh(s.mesh):
        last = np.asarray(jax.jit(lambda p, t: forward(s.model, p, t))(params, long))[0, -8:]
        cont = np.concatenate(list(generate(s.model, params, long, 8, context=context)))
    assert np.abs(last - ref["long_logits"]).max() < 1e-4
    np.testing.assert_array_equal(cont, ref["long_greedy"][0])




def cli(*args):
    from trainer.cli import main
    return main(list(args))


def save_run(name, run_dir):
    """A run.dir whose checkpoint holds exactly the fixture's parameters (no training step)."""
    from trainer.ckpt.checkpoint import Checkpointer
    from trainer.ckpt.initial import state_from_params
    s, params = loaded(name, "zero3_2x1x4")
    ck = Checkpointer(s, run_dir, log=lambda m: None)
    ck.save(1, state_from_params(s, params))
    ck.close()


def round_trip(name, tmp_path) -> tuple[dict, dict]:
    """A fixture imported into a run, exported with `meshtrain export --format hf` (in its dtype) to tmp_path/hf,
    every tensor checked back bitwise under its name; (the export's config.json, the fixture's)."""
    src = read_folder(FIX / name)
    save_run(name, tmp_path / "run")
    dtype = ["--dtype", "bfloat16"] if "bf16" in name else []
    assert cli("export", "--format", "hf", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), *dtype) == 0
    got = read_folder(tmp_path / "hf")
    assert sorted(got) == sorted(src)
    for k, (code, a) in src.items():
        assert got[k][0] == code and got[k][1].shape == a.shape, k
        assert got[k][1].tobytes() == a.tobytes(), k
    return tuple(json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", FIX / name))



def edit_config(d, **kv):
    c = json.loads((d / "config.json").read_text())
    c.update(kv)
    (d / "config.json").write_text(json.dumps(c))
