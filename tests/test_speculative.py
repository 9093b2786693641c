"""`meshtrain generate --speculative` (models/speculative.py): the multi-token-prediction modules draft, the main
model verifies, and the output is plain greedy `generate`'s token for token: on the DeepSeek fixture with
transformers' two modules (through the CLI's path, an HF folder), and on a tiny Llama trained with one module on the
built-in corpus. There the acceptance rate is the module's teacher-forced accuracy at the positions it drafted from,
computed apart by one forward of the main model and the module over the final sequence (models/transformer.py and
models/objectives/mtp.py, not the decoding caches), and above the same model's with the module re-initialised."""
import io
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.decode import generate
from models.speculative import Stats, speculative

FIX = Path(__file__).parent / "fixtures" / "hf" / "deepseek_v3_mtp_f32"


def test_fixture_drafts_with_both_modules_and_equals_greedy():
    """Through `generate --speculative`'s path (an HF folder, its two MTP layers found by their tensors) against
    plain greedy decoding of the same weights."""
    import jax.sharding as shd
    from trainer.ckpt.params import load_params
    from trainer.config import model_config
    from trainer.run.generate import completion
    drafted = completion(str(FIX), "spec", 24, temperature=0.0, out=io.StringIO(), speculative=True)
    params, cfg = load_params(str(FIX), None, shd.SingleDeviceSharding(jax.devices()[0]))
    plain = [int(t[0]) for t in generate(model_config(cfg), params, np.asarray([drafted.prompt_ids]), 24, vocab=256)]
    assert drafted.ids == plain[:len(drafted.ids)] and len(drafted.ids) > 4
    s = drafted.stats
    assert s.tokens == 24 and s.forwards == len(s.positions) + 1 and s.drafted >= 2 * (s.forwards - 2)


def test_speculative_refusals_are_one_line(tmp_path):
    from trainer.errors import UserError
    from trainer.run.generate import completion
    with pytest.raises(UserError, match=r"^--speculative decodes greedily .* drop --temperature 0.8"):
        completion(str(FIX), "x", 4, temperature=0.8, out=io.StringIO(), speculative=True)
    plain = FIX.parent / "deepseek_v3_f32"  # the same model without its modules
    with pytest.raises(UserError, match=r"has none \(model.mtp_depth=0, or an HF folder without"):
        completion(str(plain), "x", 4, temperature=0.0, out=io.StringIO(), speculative=True)


def _teacher_forced(c, params, seq) -> np.ndarray:
    """Module 1's prediction at every position t of seq (of token t + 2, reading token t + 1), from one forward."""
    from models.layers import rope_for
    from models.objectives import mtp
    from models.spec import family
    from models.transformer import embed, final_norm, head, layer_call, run_stacks
    tokens = jnp.asarray([seq[:-1]], jnp.int32)
    ahead = embed(c, params, jnp.asarray([seq[1:]], jnp.int32), jnp.float32)
    h, _ = run_stacks(c, params, embed(c, params, tokens, jnp.float32))
    call = layer_call(c, rope_for(c, tokens.shape[1]), index=c.n_layers)
    p = {k: w[0] for k, w in params["mtp"].items()}
    out, _ = mtp.depth(c, p, final_norm(c, params, h), ahead, call, family(c.family).layer)
    return np.asarray(jnp.argmax(head(c, params, out, normed=True)[0], -1))


@pytest.mark.slow
def test_trained_module_drafts_at_its_teacher_forced_accuracy():
    from flax import nnx
    from conftest import TINY, run_steps
    from models import Transformer, params_of
    r = run_steps(TINY + ["model.mtp_depth=1", "mesh.data=1", "mesh.stage=1", "mesh.model=1", "model.seq_len=64"],
                  1, steps=150)
    c, params = r.setup.model, jax.tree.map(jnp.asarray, r.params)
    prompt = np.frombuffer(b"def __init__(self, name):\n        self.", np.uint8).astype(np.int32)
    n = 20
    plain = [int(t[0]) for t in generate(c, params, prompt[None], n, context=64)]
    rates = {}
    fresh = params_of(Transformer(c, rngs=nnx.Rngs(5)))["mtp"]  # the module as a new model starts it
    for name, p in (("trained", params), ("reinit", {**params, "mtp": fresh})):
        stats = Stats()
        got = list(speculative(c, p, prompt, n, stats))
        assert got == plain, name
        seq = list(prompt) + got
        tf = _teacher_forced(c, p, seq)
        want = np.mean([tf[t] == seq[t + 2] for t in stats.positions])
        assert stats.drafted == len(stats.positions) and abs(stats.acceptance - want) < 1e-9, (name, stats, want)
        rates[name] = stats
    print({k: (s.acceptance, s.per_forward) for k, s in rates.items()})
    assert rates["trained"].acceptance > rates["reinit"].acceptance
    assert rates["trained"].per_forward > 1.2


@pytest.mark.slow
def test_the_cli_trains_modules_and_drafts_with_them(tmp_path, capfd):
    """`meshtrain train ... model.mtp_depth=1` (planner, memory check, metrics with aux/mtp_1), then `meshtrain
    generate --speculative`: the plain greedy text, and the drafts' line on stderr."""
    import json
    from conftest import TINY
    from hf_check import cli
    run = tmp_path / "run"
    assert cli("train", *TINY, "model.mtp_depth=1", "train.steps=30", f"run.dir={run}") == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("aux/mtp_1" in x for x in lines)
    capfd.readouterr()
    assert cli("generate", "--run", str(run), "--prompt", "def ", "--tokens", "20", "--temperature", "0") == 0
    plain = capfd.readouterr().out
    assert cli("generate", "--run", str(run), "--prompt", "def ", "--tokens", "20", "--speculative") == 0
    got = capfd.readouterr()
    assert got.out == plain and "drafts accepted (acceptance rate" in got.err
