"""LoRA in and out of peft's format (trainer/ckpt/peft.py), against peft 0.21 itself: the fixtures of
scripts/make_peft_fixture.py (tests/fixtures/peft: a tiny Llama base; adapters peft drew with a non-zero B, with and
without use_rslora, and PeftModel's logits of them; meshtrain's own LoRA run from that base exported with
`--format peft` and loaded by PeftModel, its logits). An adapter peft made gives peft's logits in meshtrain (1e-4, a
short and a 420-token prompt); meshtrain's run, trained again here (3 SGD steps on (2,1,4) ZeRO-3, the script's
command), exports an adapter that peft turns into meshtrain's logits (1e-4), moved by more than 1e-2 from the
base's; the merged export (`--format hf --merge`) gives them too."""
import json
from pathlib import Path

import numpy as np
import pytest

import jax

from conftest import TINY

FIX = Path(__file__).parent / "fixtures" / "peft"
TRAIN = json.loads((FIX / "trained" / "command.json").read_text())  # the run the fixture was made of

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q_proj,v_proj,o_proj,down_proj]"]
ONE = ["mesh.data=1", "mesh.stage=1", "mesh.model=1"]


def _logits(over, ref):
    """The logits of the reference tokens and of the long prompt's last 8, from one forward of both (the short rows
    zero-padded at the end: attention is causal), under the config `over` (its parameters as init_params reads them)."""
    from models.transformer import forward
    from trainer import load_config, resolve
    from trainer.ckpt.params import init_params
    from trainer.state import make_setup
    cfg = resolve(load_config(TINY + ONE + ["train.batch_size=4", "model.seq_len=420", *over]))
    s = make_setup(cfg, jax.devices()[:1])
    params = init_params(s, cfg.model.init_from)
    long, T = ref["long_prompt"], ref["tokens"].shape[1]
    rows = np.zeros((3, long.shape[1]), np.int32)
    rows[:2, :T], rows[2] = ref["tokens"], long[0]
    with jax.set_mesh(s.mesh):
        got = np.asarray(jax.jit(lambda p, t: forward(s.model, p, t))(params, rows))
    return got[:2, :T], got[2, -8:]


@pytest.mark.parametrize("name", ["peft_r4", pytest.param("peft_r4_rslora", marks=pytest.mark.slow)])
def test_an_adapter_peft_made_gives_peft_logits(name):
    ref = np.load(FIX / name / "reference.npz")
    rs = ["model.lora.use_rslora=true"] if "rslora" in name else []
    short, long = _logits([f"model.init_from={FIX / 'llama_base'}", *LORA, *rs,
                           f"model.lora.init_from={FIX / name}"], ref)
    assert float(ref["moved"]) > 1e-2
    assert np.abs(short - ref["logits"]).max() < 1e-4 and np.abs(long - ref["long_logits"]).max() < 1e-4


def test_a_trained_adapter_exports_to_peft_and_merged(tmp_path):
    from hf_check import cli, read_folder
    run, adapter = tmp_path / "run", tmp_path / "adapter"
    assert cli("train", f"model.init_from={FIX / 'llama_base'}", f"run.dir={run}", *TRAIN) == 0
    assert cli("export", "--run", str(run), "--format", "peft", "--out", str(adapter)) == 0
    ref = np.load(FIX / "trained" / "reference.npz")
    short, long = _logits([f"model.init_from={FIX / 'llama_base'}", *LORA, f"model.lora.init_from={adapter}"], ref)
    base = np.load(FIX / "llama_base" / "reference.npz")["logits"]
    assert float(ref["moved"]) > 1e-2 and np.abs(short - base).max() > 1e-2  # the adapter moved them
    assert np.abs(short - ref["logits"]).max() < 1e-4 and np.abs(long - ref["long_logits"]).max() < 1e-4
    got, want = read_folder(adapter), read_folder(FIX / "trained" / "adapter")
    assert sorted(got) == sorted(want)
    assert cli("export", "--run", str(run), "--format", "hf", "--merge", "--out", str(tmp_path / "merged")) == 0
    short, long = _logits([f"model.init_from={tmp_path / 'merged'}"], ref)
    assert np.abs(short - ref["merged_logits"]).max() < 1e-4
    assert np.abs(long - ref["merged_long_logits"]).max() < 1e-4
