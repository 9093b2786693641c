"""Preference tuning (train.objective=dpo): pairs tokenized as TRL 1.16 tokenizes them, one lr-0 step's loss and every
metric equal to TRL's DPOTrainer for each loss variant (tests/fixtures/dpo, made by scripts/make_dpo_fixture.py in a
venv of its own), every layout equal to one device (SGD without clipping: losses, grad norms, parameters), the
precomputed and the online reference equal, learning a rule on held-out pairs, and bad input as one line each."""
import functools
import json
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from conftest import SGD

from trainer.cli import main
from trainer.errors import UserError

FIX = Path(__file__).parent / "fixtures" / "dpo"
REF = json.loads((FIX / "reference.json").read_text())
METRICS = ["loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected"]
VARIANTS = {"sigmoid": [], "ipo": ["dpo.loss=ipo"], "hinge": ["dpo.loss=hinge"],
            "robust": ["dpo.loss=robust", "dpo.label_smoothing=0.1"], "sigmoid_sft": ["dpo.sft_weight=0.5"]}


def _prepare(src, out, *more) -> int:
    return main(["prepare", str(src), "--out", str(out), "--tokenizer", str(FIX / "policy"), "--no-progress", *more])


@pytest.fixture(scope="module")
def fixture_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo")
    for kind in ("text", "chat"):
        assert _prepare(FIX / f"pairs_{kind}.jsonl", d / f"{kind}.bin", "--max-length", str(REF["max_length"]),
                        "--heldout", "0") == 0
    return d


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_pairs_are_tokenized_as_trl(fixture_data, kind):
    """Each pair's two sequences (prompt + answer, cut to max_length keeping the start) and their completion masks
    are TRL's; the pair whose prompt alone fills max_length is dropped and counted."""
    meta = json.loads((fixture_data / f"{kind}.bin.json").read_text())
    toks = np.fromfile(fixture_data / f"{kind}.bin", np.uint16)
    mask = np.fromfile(fixture_data / meta["loss_mask"]["path"], np.uint8)
    idx = np.fromfile(fixture_data / meta["document_index"]["path"], np.uint64).astype(int)
    trl = REF[kind]["tokens"]
    assert meta["pairs"] == {"train": len(trl), "heldout": 0, "dropped": 1, "max_length": REF["max_length"]}
    for i, t in enumerate(trl):
        for j, answer in enumerate(("chosen_ids", "rejected_ids")):
            a, b, n = idx[2 * i + j], idx[2 * i + j + 1], REF["max_length"]
            assert toks[a:b].tolist() == (t["prompt_ids"] + t[answer])[:n], (i, answer)
            assert mask[a:b].tolist() == ([0] * len(t["prompt_ids"]) + [1] * len(t[answer]))[:n], (i, answer)


def _fixture_step(data: Path, kind: str, variant: str, weight=None) -> tuple:
    """(the step's metrics, the policy's and the reference's log-probability of every target, the batch): every pair
    at once, the reference read from its folder; `weight` maps the batch's loss_weight to the one the step uses."""
    from models.objectives.objective import aux_counts, part_metrics
    from trainer.ckpt.params import init_params
    from trainer.ckpt.sources import resolve
    from trainer.config import load_config
    from trainer.data.batches import Batches, load_corpus
    from trainer.run import reference
    from trainer.state import make_setup
    from trainer.step import loss_and_grads
    n = len(REF[kind]["tokens"])
    cfg = resolve(load_config([f"data.source={data / kind}.bin", f"model.init_from={FIX / 'policy'}",
                               f"dpo.reference={FIX / 'reference'}", "train.objective=dpo", f"train.batch_size={n}",
                               "mesh.data=1", f"dpo.beta={REF['beta']}", *VARIANTS[variant]]))
    s = make_setup(cfg, jax.devices()[:1])
    b = Batches(load_corpus(cfg.data.source), 0, n, s.model.seq_len, s.model.vocab_size, evaluates=False,
                document_mask=True)
    host = b.global_train(0)  # every pair once
    if weight is not None:
        host["loss_weight"] = weight(host["loss_weight"])
    batch, policy, logp = jax.device_put(host, s.batch_sharding()), init_params(s, cfg.model.init_from), \
        reference.logp_fn(s)
    with jax.set_mesh(s.mesh):
        pi = logp(policy, batch)
        batch["ref_logp"] = logp(reference.load(s, lambda _: None), batch)
        parts, grads = jax.jit(functools.partial(loss_and_grads, s))(policy, batch)
    metrics = part_metrics(parts, aux_counts(s.model, batch))
    got = {**{k: float(v) for k, v in metrics.items()}, "grad_norm": float(optax.tree.norm(grads))}
    return got, np.asarray(pi), np.asarray(batch["ref_logp"]), jax.tree.map(np.asarray, host)


def _one_step(data: Path, kind: str, variant: str) -> dict:
    """The policy's loss, grad norm and metrics on every pair at once, the reference read from its folder."""
    return _fixture_step(data, kind, variant)[0]


@pytest.mark.parametrize("kind,variant", [("text", v) for v in VARIANTS] + [("chat", "sigmoid_sft")] + [
    pytest.param("chat", v, marks=pytest.mark.slow) for v in VARIANTS if v != "sigmoid_sft"])
def test_one_step_equals_trl(fixture_data, kind, variant):
    """loss, grad_norm and rewards/*, logps/* of one step at learning rate 0 = TRL's, relative 1e-5."""
    got, want = _one_step(fixture_data, kind, variant), REF[kind][variant]
    worst = max(abs(got[k] - want[k]) / max(abs(want[k]), 1.0) for k in METRICS)
    print(f"{kind} {variant}: largest difference from TRL, relative to max(|TRL's|, 1): {worst:.2g}")
    for k in METRICS:
        assert abs(got[k] - want[k]) <= 1e-5 * max(abs(want[k]), 1.0), (k, got[k], want[k])


def _by_hand(pi, ref, batch, sft_weight: float) -> dict:
    """TRL's sigmoid DPO + sft by hand (numpy, float64): each answer's log-probabilities summed with the loss weight
    (TRL's completion mask, here fractional), the pair loss a mean over pairs, the sft term the chosen answers' weighted
    mean token loss."""
    w, seg, beta = batch["loss_weight"].astype(np.float64), batch["segment_ids"], REF["beta"]
    tot = lambda v, k: np.sum(np.where(seg == k, v * w, 0.0), axis=-1)  # noqa: E731
    chosen, rejected = tot(pi, 1) - tot(ref, 1), tot(pi, 2) - tot(ref, 2)
    pair = np.mean(np.logaddexp(0.0, -beta * (chosen - rejected)))  # -log sigmoid
    sft = np.sum(tot(-pi, 1)) / np.sum(tot(1.0, 1))
    return {"loss": pair + sft_weight * sft, "logps/chosen": np.mean(tot(pi, 1)),
            "rewards/chosen": np.mean(beta * chosen), "rewards/margins": np.mean(beta * (chosen - rejected))}


def test_a_fractional_loss_weight_counts_once(fixture_data):
    """The answers' targets weighted 0.3 and 0.8 in turn: loss (sigmoid + sft 0.5), logps/chosen and rewards/* equal
    TRL's formula by hand on the same per-token log-probabilities, each weighted once (not w^2); the hand formula
    with the 0/1 mask gives TRL's own loss (the fixture), so it is TRL's."""
    frac = lambda w: w * np.where(np.arange(w.shape[-1]) % 2, 0.3, 0.8).astype(np.float32)  # noqa: E731
    got, pi, ref, batch = _fixture_step(fixture_data, "text", "sigmoid_sft", frac)
    want = _by_hand(pi, ref, batch, 0.5)
    trl = _by_hand(pi, ref, {**batch, "loss_weight": np.ceil(batch["loss_weight"])}, 0.5)
    assert abs(trl["loss"] - REF["text"]["sigmoid_sft"]["loss"]) <= 1e-5 * REF["text"]["sigmoid_sft"]["loss"]
    print(f"fractional weights: largest relative difference from the hand formula "
          f"{max(abs(got[k] / want[k] - 1) for k in want):.2g}")
    for k in want:
        assert abs(got[k] - want[k]) <= 1e-5 * max(abs(want[k]), 1.0), (k, got[k], want[k])


# Layouts: a tiny model (vocabulary 1032, divisible by every model axis here) on synthetic pairs whose chosen answers
# use warm colours and the rejected ones cold colours; the reference is another random initialisation.
TINY = ["model.preset=tiny", "model.vocab_size=1032", "model.n_layers=4", "model.seq_len=64", "train.batch_size=8",
        "train.warmup_steps=0", "run.progress=false", "run.log_every=1", "checkpoint.every=0"]
WARM, COLD = "red orange warm sunny bright hot golden".split(), "blue grey cold icy dark frozen pale".split()


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """(prepared pairs, a run holding the reference's parameters)."""
    import random

    from trainer.ckpt.checkpoint import Checkpointer
    from trainer.config import load_config
    from trainer.state import init_state, make_setup
    d, rng = tmp_path_factory.mktemp("synth"), random.Random(1)
    recs = []
    for _ in range(300):
        n = rng.randint(2, 5)
        recs.append({"prompt": "Colours: " + " ".join(rng.choice(WARM + COLD) for _ in range(rng.randint(2, 5))) + ".",
                     "chosen": " " + " ".join(rng.choice(WARM) for _ in range(n)) + ".",
                     "rejected": " " + " ".join(rng.choice(COLD) for _ in range(n)) + "."})
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert _prepare(d / "pairs.jsonl", d / "pairs.bin", "--max-length", "32", "--heldout", "0.1") == 0
    s = make_setup(load_config(TINY + ["mesh.data=1", "train.seed=1"]), jax.devices()[:1])
    c = Checkpointer(s, d / "reference")
    c.save(1, init_state(s))
    c.close()
    return d / "pairs.bin", d / "reference"


def _keys(synth, tmp: Path, extra: list[str], steps: int = 3) -> list[str]:
    data, ref = synth
    return TINY + SGD + [f"data.source={data}", f"dpo.reference={ref}", "train.objective=dpo", "train.lr=0.5",
                         f"train.steps={steps}", "train.eval_every=0", f"run.dir={tmp / 'run'}", *extra]


def _train(synth, tmp: Path, extra: list[str], devices: int, steps: int = 3):
    from trainer.config import load_config
    from trainer.run.loop import train
    r = train(load_config(_keys(synth, tmp, extra, steps)), jax.devices()[:devices])
    hist = [h for h in r.history if "loss" in h]
    return (np.array([h["loss"] for h in hist]), np.array([h["grad_norm"] for h in hist]),
            jax.tree.map(np.asarray, r.state["params"]), hist)


@functools.lru_cache(maxsize=None)
def _one_device(synth):
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        return _train(synth, Path(tmp), ["mesh.data=1"], 1)


LAYOUTS = {
    "214_zero3": ["mesh.data=2", "mesh.model=4", "train.zero_stage=3"],
    "214_zero3_online": ["mesh.data=2", "mesh.model=4", "train.zero_stage=3", "dpo.reference_mode=online"],
    "241_1f1b_m4": ["mesh.data=2", "mesh.stage=4", "train.pipeline_schedule=1f1b", "train.microbatches=4"],
    "241_gpipe_m4": ["mesh.data=2", "mesh.stage=4", "train.pipeline_schedule=gpipe", "train.microbatches=4"],
    "124_interleaved_v2": ["mesh.data=1", "mesh.stage=2", "mesh.model=4", "train.pipeline_schedule=interleaved_1f1b",
                           "train.microbatches=4", "train.pipeline_repeats=2"],
    "811_ring": ["mesh.data=8", "train.grad_sync=ring"],
    "214_m2": ["mesh.data=2", "mesh.model=4", "train.microbatches=2"],
    "214_m2_online": ["mesh.data=2", "mesh.model=4", "train.microbatches=2", "dpo.reference_mode=online"],
}


# the default run keeps (2,1,4) ZeRO-3 with the reference online; its one-device run reads the precomputed reference
# (written beside the data: the column a batch carries, split over `data` as the tokens are), so 214_zero3 (the
# precomputed reference on that layout, 7 s) runs with the rest under -m slow
@pytest.mark.parametrize("layout", [x if x == "214_zero3_online" else pytest.param(x, marks=pytest.mark.slow)
                                    for x in LAYOUTS])
def test_layout_equals_one_device(synth, tmp_path, layout, capsys):
    """3 SGD steps: losses, grad norms and parameters within 1e-5 of one device; the reference precomputed (written
    beside the data, read back by the next run) or online. The step lines print the loss in nats per pair."""
    ref = _one_device(synth)
    capsys.readouterr()
    got = _train(synth, tmp_path, LAYOUTS[layout], 8)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step ")]
    assert len(lines) == 3 and all(f"| loss {h['loss']:.3f} nats/pair | grad norm" in x for x, h in zip(lines, got[3])), \
        lines
    assert np.allclose(got[0], ref[0], rtol=1e-5) and np.allclose(got[1], ref[1], rtol=1e-5), (got[:2], ref[:2])
    rel = [float(np.linalg.norm(a - b) / np.linalg.norm(b))
           for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(ref[2]))]
    print(f"{layout}: losses {np.max(np.abs(got[0] / ref[0] - 1)):.2g}, grad norms "
          f"{np.max(np.abs(got[1] / ref[1] - 1)):.2g}, parameters {max(rel):.2g} (relative, against one device)")
    assert max(rel) <= 1e-5
    assert all(0 <= h["rewards/accuracies"] <= 1 for h in got[3])
    assert len(list(synth[0].parent.glob("pairs.bin.ref-*.f32"))) == 1  # one reference file: same hash every run


@pytest.mark.slow  # two more runs (~8 s)
def test_bfloat16_layout_follows_one_device(synth, tmp_path):
    """bfloat16 compute on (2,1,4) ZeRO-3 against one device in bfloat16: the same losses within bfloat16's rounding
    (2e-2; the sums run in another order), both learning."""
    one = _train(synth, tmp_path / "one", ["mesh.data=1", "train.dtype=bfloat16"], 1)
    got = _train(synth, tmp_path / "214", ["mesh.data=2", "mesh.model=4", "train.zero_stage=3", "train.dtype=bfloat16"],
                 8)
    assert np.allclose(got[0], one[0], rtol=2e-2) and got[0][-1] < got[0][0], (got[0], one[0])


@pytest.mark.slow  # 100 steps (~15 s)
def test_it_learns_the_rule_on_held_out_pairs(synth, tmp_path):
    """100 AdamW steps from the reference: held-out rewards/accuracies above 0.9."""
    got = _train(synth, tmp_path, ["mesh.data=8", "train.optimizer=adamw", "train.grad_clip=1", "train.lr=1e-3",
                                   "train.warmup_steps=10", "train.eval_every=100", "train.eval_batches=4",
                                   f"model.init_from={synth[1]}"], 8, steps=100)
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [e for e in evals if "eval_rewards/accuracies" in e][-1]
    print(f"step 100: eval_loss {last['eval_loss']:.4f}, eval_rewards/accuracies {last['eval_rewards/accuracies']:.3f}"
          f" over {last['eval_pairs']} held-out pairs")
    assert last["eval_rewards/accuracies"] > 0.9 and got[0][-1] < got[0][0]


BAD = [
    ({"prompt": "a", "chosen": "", "rejected": "b"}, r"'chosen' is empty"),
    ({"prompt": "a", "chosen": " b", "rejected": " b"}, r"'chosen' and 'rejected' are the same answer"),
    ({"prompt": "a", "chosen": " b"}, r"is a preference pair without 'rejected'"),
    ({"chosen": " b", "rejected": " c"}, r"is a preference pair without 'prompt'"),
    ({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": " c"}, r"must all be strings"),
]


@pytest.mark.parametrize("record,message", BAD)
def test_a_bad_pair_is_one_line(tmp_path, capsys, record, message):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x", "chosen": " y", "rejected": " z"}) + "\n"
                                      + json.dumps(record) + "\n")
    assert _prepare(tmp_path / "p.jsonl", tmp_path / "p.bin") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "p.jsonl:2" in err and __import__("re").search(message, err), err
    assert not (tmp_path / "p.bin").exists()


def test_bad_setups_are_one_line(synth, tmp_path):
    """A reference of another vocabulary, objective=dpo on data without pairs, no reference at all, DPO under context
    parallelism."""
    from trainer.config import load_config, validate
    from trainer.data.batches import Batches, load_corpus
    from trainer.run import reference
    from trainer.state import make_setup
    keys = TINY + [f"data.source={synth[0]}", "train.objective=dpo", "mesh.data=1"]
    s = make_setup(load_config(keys + [f"dpo.reference={FIX / 'reference'}"]), jax.devices()[:1])
    with pytest.raises(UserError, match=rf"^dpo.reference '{FIX / 'reference'}' does not fit this model: .*1025"):
        reference.load(s, print)
    s = make_setup(load_config(keys + [f"dpo.reference={synth[1]}", "data.source=synthetic"]),
                   jax.devices()[:1])
    with pytest.raises(UserError, match=r"^train.objective=dpo trains on preference pairs, and data.source 'synthetic'"):
        reference.Reference(s, Batches(load_corpus("synthetic"), 0, 8, 64, 1032), slice(0, 8), None, print)
    with pytest.raises(UserError, match=r"^train.objective=dpo needs a reference model"):
        validate(load_config(keys), 1)
    with pytest.raises(UserError, match=r"^train.objective=dpo sums each pair's log-probabilities along its row"):
        validate(load_config(TINY + ["train.objective=dpo", "mesh.data=2", "mesh.context=4", "dpo.reference=x"]), 8)


def test_the_planner_counts_the_online_reference():
    """dpo.reference_mode=online holds the reference's parameters beside the policy's, in the same layout: the plan
    adds exactly the parameters' bytes per device (2 x 4 and 8 x 1 layouts); precompute adds nothing."""
    from trainer.config import load_config, model_config
    from trainer.hardware import DEVICES
    from trainer.plan.core import estimate, strategy_of
    for mesh in (["mesh.data=2", "mesh.model=4", "train.zero_stage=3"], ["mesh.data=8"]):
        plans = {}
        for mode in ("precompute", "online"):
            cfg = load_config(TINY + mesh + ["train.objective=dpo", "dpo.reference=x", f"dpo.reference_mode={mode}"])
            plans[mode] = estimate(model_config(cfg), cfg.train, strategy_of(cfg, 8), DEVICES["h100-80g"], 1, "float32")
        assert plans["precompute"].reference_bytes == 0 and plans["online"].reference_bytes > 0
        assert plans["online"].reference_bytes == plans["online"].params_bytes == plans["precompute"].params_bytes
        assert plans["online"].total_bytes - plans["precompute"].total_bytes == plans["online"].params_bytes


def test_online_reference_under_a_pipeline_is_one_line(synth, tmp_path):
    """Its forward would run outside the pipeline (every layer's weights across the stages on each step): refused in
    one line before anything compiles or is written; precompute runs there (the layout tests)."""
    with pytest.raises(UserError, match=r"^dpo.reference_mode=online runs the reference's forward outside the "
                                        r"pipeline .* mesh.stage=4 .* set dpo.reference_mode=precompute"):
        _train(synth, tmp_path, ["mesh.data=2", "mesh.stage=4", "train.microbatches=4", "dpo.reference_mode=online"],
               8)
    assert not (tmp_path / "run").exists()


def test_the_memory_check_holds_the_online_reference(synth, tmp_path, monkeypatch):
    """dpo.reference_mode=online keeps the reference's parameters beside the step: the plan's margin on an
    accelerator counts them whole (they are shapes, exact, not a tenth as an estimate), and the run holds its
    compiled step's figures plus them (the bytes from the run's shardings, equal to the planner's): a limit above
    the step alone but under it plus the parameters stops in one line that names the reference."""
    import dataclasses

    from trainer.config import load_config
    from trainer.hardware import DEVICES
    from trainer.plan.core import estimate, strategy_of
    from trainer.run import context, memory_check
    from trainer.state import make_setup
    online = ["mesh.data=1", "dpo.reference_mode=online"]
    s = make_setup(load_config(_keys(synth, tmp_path, online)), jax.devices()[:1])
    plan = estimate(s.model, s.cfg.train, strategy_of(s.cfg, 1), DEVICES["h100-80g"], 1, "float32")
    exact, ref = plan.params_bytes + plan.opt_state_bytes, plan.reference_bytes
    assert ref == plan.params_bytes == memory_check.reference_bytes(s) > 0
    rest = plan.total_bytes - exact - ref  # a tenth of it held on an accelerator (SLACK)
    between = exact + (ref + rest) / memory_check.SLACK + ref / 2  # the reference as an estimate fits, whole not

    def limit(b):
        return memory_check.Limit(dataclasses.replace(plan.device, hbm=b), "the test's limit", exact=False)
    with pytest.raises(UserError, match=r"^the plan needs at least"):
        memory_check.check_plan(plan, limit(between))
    seen = []

    def held_by_the_run(fp, lim, held=0):  # what the run holds against its device, once compiled
        seen.append((fp, held))
        raise KeyboardInterrupt
    monkeypatch.setattr(context, "check_compiled", held_by_the_run)
    with pytest.raises(KeyboardInterrupt):
        _train(synth, tmp_path, online, 1)
    (fp, held), = seen
    assert held == ref
    memory_check.check_compiled(fp, limit(fp.total_bytes + ref / 2))  # the step alone fits
    with pytest.raises(UserError, match=r"^the compiled train step needs .* \+ DPO reference \(online\) "):
        memory_check.check_compiled(fp, limit(fp.total_bytes + ref / 2), held)


@pytest.mark.slow  # ~12 s: moto's server answers every block of the precompute and the steps
def test_pairs_in_object_storage_train_as_on_disk(synth, s3, tmp_path, monkeypatch):
    """The prepared pairs uploaded to s3:// (moto): 3 SGD steps equal the local file's one-device run (losses, grad
    norms, parameters), the reference's log-probabilities computed once and kept in $MESHTRAIN_CACHE/dpo/."""
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path / "cache"))
    data = synth[0]
    for f in data.parent.glob(data.name + "*"):
        if ".ref-" not in f.name:
            s3.pipe_file(f"bkt/dpo/{f.name}", f.read_bytes())
    ref = _one_device(synth)
    got = _train((f"s3://bkt/dpo/{data.name}", synth[1]), tmp_path, ["mesh.data=1"], 1)
    assert np.allclose(got[0], ref[0], rtol=1e-6) and np.allclose(got[1], ref[1], rtol=1e-6), (got[:2], ref[:2])
    assert all(np.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(jax.tree.leaves(got[2]),
                                                                           jax.tree.leaves(ref[2])))
    (cached,) = (tmp_path / "cache" / "dpo" / "s3" / "bkt" / "dpo").glob(data.name + ".ref-*.f32")
    # the local run's cache beside the pairs, by the same key (the module's other tests leave theirs there too)
    local = data.parent / cached.name
    assert local.is_file() and cached.read_bytes() == local.read_bytes(), sorted(data.parent.glob("*.ref-*"))


def _tree(d: Path) -> list:
    """Every file and folder under d with its size: what a refusal must leave as it was."""
    return sorted((str(p.relative_to(d)), p.stat().st_size if p.is_file() else None) for p in d.rglob("*"))


def _refused(args: list[str], capsys) -> str:
    """The one line that `meshtrain ARGS` exits 2 with."""
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_missing_reference_is_named_by_its_key(synth, tmp_path, capsys):
    """dpo.reference that does not exist is refused naming dpo.reference (it was reported as model.init_from, after
    the step compiled); with dpo.reference unset, model.init_from named as the reference. Nothing is written."""
    keys = ["train", *TINY, f"data.source={synth[0]}", "train.objective=dpo", "mesh.data=8", "train.steps=1",
            f"run.dir={tmp_path / 'run'}"]
    before = _tree(synth[0].parent)
    err = _refused([*keys, f"dpo.reference={tmp_path / 'nope'}"], capsys)
    assert err.startswith(f"meshtrain: error: dpo.reference '{tmp_path / 'nope'}' does not exist; give the frozen "
                          "reference"), err
    err = _refused([*keys, f"model.init_from={tmp_path / 'nope'}"], capsys)
    assert f"model.init_from '{tmp_path / 'nope'}' (the reference: dpo.reference is unset) does not exist" in err, err
    assert not (tmp_path / "run").exists() and _tree(synth[0].parent) == before


def test_a_reference_of_another_architecture_names_what_differs(synth, tmp_path, capsys):
    """A Hugging Face reference of 2 layers (its config.json's facts) against a 4-layer policy was 'incomplete' (it
    lacks layers 2 and 3); a run of 4 layers against a 2-layer policy named model.init_from and told to change the
    policy. Both: one line, before anything compiles, naming each fact that differs (reference vs policy)."""
    keys = ["train", *TINY, f"data.source={synth[0]}", "train.objective=dpo", "mesh.data=8", "train.steps=1",
            f"run.dir={tmp_path / 'run'}"]
    hc = json.loads((FIX / "reference" / "config.json").read_text())
    err = _refused([*keys, "model.vocab_size=1025", f"dpo.reference={FIX / 'reference'}"], capsys)
    assert f"dpo.reference '{FIX / 'reference'}' is a model of another architecture than this run's" in err, err
    for fact in (f"n_layers {hc['num_hidden_layers']} vs 4", f"n_heads {hc['num_attention_heads']} vs 8",
                 f"head_dim {hc['head_dim']} vs 8", f"norm_eps {hc['rms_norm_eps']} vs 1e-05"):
        assert fact in err, (fact, err)
    assert "incomplete" not in err and "vocab_size" not in err and "d_model" not in err
    err = _refused([*keys, "model.n_layers=2", f"dpo.reference={synth[1]}"], capsys)
    assert "(reference vs policy: n_layers 4 vs 2)" in err and "model.init_from" in err.split(";")[1], err
    assert not (tmp_path / "run").exists()


def test_a_max_length_that_drops_every_pair_says_so(tmp_path, capsys):
    """Every prompt at least --max-length long: the line blames --max-length (it blamed '--heldout 0.0') and gives the
    length that keeps every pair and the one that keeps the shortest prompt's; each does (TRL's shortest kept prompt
    has 9 tokens, the fixture's longest is the pair dropped at max_length 48)."""
    shortest = min(len(t["prompt_ids"]) for t in REF["text"]["tokens"])
    err = _refused(["prepare", str(FIX / "pairs_text.jsonl"), "--out", str(tmp_path / "p.bin"), "--tokenizer",
                    str(FIX / "policy"), "--no-progress", "--heldout", "0", "--max-length", "4"], capsys)
    assert "all 5 preference pairs were dropped: each one's prompt alone reaches --max-length" in err, err
    assert "--heldout" not in err and f"({shortest + 1} keeps the shortest)" in err, err
    keeps_all = int(err.split("give --max-length ")[1].split()[0])
    assert not list(tmp_path.iterdir())
    for n, dropped in ((keeps_all, 0), (keeps_all - 1, 1), (shortest + 1, 4)):
        assert _prepare(FIX / "pairs_text.jsonl", tmp_path / f"{n}.bin", "--heldout", "0", "--max-length", str(n)) == 0
        assert json.loads((tmp_path / f"{n}.bin.json").read_text())["pairs"]["dropped"] == dropped, n


def test_dpo_keys_under_the_token_loss_are_one_warning(caplog):
    """dpo.* keys set while train.objective=lm are ignored: one warning naming them; none under dpo or when unset."""
    from trainer.config import load_config, validate

    def warned(keys):
        caplog.clear()
        validate(load_config(TINY + keys), 1)
        return [r.getMessage() for r in caplog.records if "dpo." in r.getMessage()]
    got = warned(["dpo.beta=0.25", "dpo.loss=ipo"])
    assert len(got) == 1 and got[0].startswith("dpo.beta=0.25, dpo.loss=ipo ignored: train.objective=lm"), got
    assert warned(["train.objective=dpo", "dpo.beta=0.25", "dpo.reference=x"]) == [] and warned([]) == []


def test_a_resume_keeps_its_reference_or_says_it_changed(synth, tmp_path, capsys, caplog):
    """A DPO run trained against reference A (a copy of the synthetic reference's checkpoint, its saved config made a
    DPO run's against A, as a run would save it): resumed with dpo.reference dropped (model.init_from B would become
    the reference) it is refused in one line naming A and B, nothing touched (it switched silently and logged
    'dpo.reference A -> None'); resumed with dpo.reference=B it warns that the objective changes at the resumed
    step; with dpo.reference=A it says nothing."""
    import shutil

    from trainer.config import load_config
    from trainer.run import reference
    from trainer.state import make_setup
    a, b, run = synth[1], tmp_path / "other", tmp_path / "run"
    shutil.copytree(a, b)
    shutil.copytree(a, run)
    (meta,) = run.glob("checkpoints/*/meta/metadata")
    saved = json.loads(meta.read_text())
    saved["config"]["train"]["objective"], saved["config"]["dpo"]["reference"] = "dpo", str(a)
    meta.write_text(json.dumps(saved))
    step = saved["step"]
    base = [*TINY, f"data.source={synth[0]}", "train.objective=dpo", "mesh.data=1", f"run.dir={run}"]
    before = _tree(tmp_path)
    err = _refused(["train", *base, "mesh.data=8", "train.steps=4", f"model.init_from={b}"], capsys)
    assert f"run.dir {run} was trained to step {step} against the DPO reference '{a}'" in err, err
    assert f"model.init_from '{b}' the reference" in err and f"set dpo.reference={a} to resume as trained" in err, err
    assert _tree(tmp_path) == before
    caplog.clear()
    for ref in (a, b):
        reference.check(make_setup(load_config([*base, "train.steps=4", f"model.init_from={b}", f"dpo.reference={ref}"]),
                                   jax.devices()[:1]))
    got = [r.getMessage() for r in caplog.records if "dpo.reference" in r.getMessage()]
    assert len(got) == 1 and got[0].startswith(f"dpo.reference changed on resume: the steps to {step} were trained "
                                               f"against '{a}', and from step {step + 1} the reference is '{b}': the "
                                               "DPO objective changes there"), got


def test_the_dpo_loss_is_printed_in_nats_per_pair():
    """The last line's held-out loss: nats per pair for DPO (its sft term named), nats/token and bits/byte for the
    token loss."""
    from types import SimpleNamespace as NS

    from models.objectives.dpo import Dpo
    from trainer.run.loop import _eval_words

    def words(dpo):
        return _eval_words(NS(eval_loss=0.5, batches=NS(c=NS(bytes_per_token=2.0)), s=NS(model=NS(dpo=dpo))))
    assert words(Dpo()) == ", eval DPO loss 0.5000 nats/pair"
    assert words(Dpo(sft_weight=0.5)) == ", eval DPO loss 0.5000 nats/pair + 0.5 x nats/chosen token"
    assert words(None) == f", eval loss 0.5000 nats/token ({0.5 / np.log(2) / 2.0:.4f} bits/byte)"
