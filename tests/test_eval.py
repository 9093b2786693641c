"""`meshtrain eval`: lm-evaluation-harness on meshtrain's model (trainer/run/harness.py), its three request kinds on
the shipped offline tasks (trainer/eval_tasks), on one device and on (2,1,4); each loglikelihood request's figure
against a forward of that request alone through the KV-cache decoder (models/decode.py, another attention path, no
padding, no batching); and the one-line refusals."""
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.errors import UserError

EVAL = Path(__file__).parent / "fixtures" / "eval"
FIX = EVAL / "llama"  # a tiny HF Llama trained on the generation task, with its tokenizer and chat template
MOE = EVAL / "mixtral"  # a tiny random Mixtral (4 experts, 2 per token), router margins above 1e-3 on every request
TASKS = ["meshtrain_mc", "meshtrain_rolling", "meshtrain_gen"]


@pytest.fixture(scope="module")
def one_device():
    import os
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from trainer.run.harness import evaluate
    return evaluate(str(FIX), TASKS, ["mesh.data=1"], log_samples=True, max_length=64)  # windows, left truncation


def _alone(c, params, ids, cont) -> tuple[float, bool]:
    """(sum of the continuation's log-probabilities, all greedy) of one request's ids, through the decoder."""
    from models.decode import hidden, init_cache
    from models.transformer import head
    fn = jax.jit(lambda p, t: jax.nn.log_softmax(head(c, p, hidden(c, p, t, 0, init_cache(c, 1, t.shape[1]))[0])
                                                 .astype(jnp.float32), axis=-1)[0])
    logp = np.asarray(fn(params, jnp.asarray([ids], jnp.int32)))
    n = len(cont)
    picked = [float(logp[len(ids) - n - 1 + i, t]) for i, t in enumerate(cont)]
    greedy = all(int(np.argmax(logp[len(ids) - n - 1 + i])) == t for i, t in enumerate(cont))
    return sum(picked), greedy


def test_the_three_kinds_run_and_each_loglikelihood_is_the_request_alone(one_device):
    from trainer.ckpt.params import load_params
    from trainer.config import model_config
    from trainer.run.harness import Tokenizer
    r = one_device
    assert set(r["results"]) == set(TASKS)
    assert 0 <= r["results"]["meshtrain_mc"]["acc,none"] <= 1 and r["results"]["meshtrain_rolling"][
        "bits_per_byte,none"] > 0 and "exact_match,strip" in r["results"]["meshtrain_gen"]
    params, cfg = load_params(str(FIX))
    c = model_config(cfg)
    tok = Tokenizer(FIX / "tokenizer.json")
    for s in r["samples"]["meshtrain_mc"][:3]:  # 12 requests, each compiled at its own length
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            whole, ctx = tok.encode(context + continuation), tok.encode(context)
            got, greedy = resp[0]
            want, want_greedy = _alone(c, params, whole, whole[len(ctx):])
            assert abs(got - want) < 1e-4 and greedy == want_greedy, (context, continuation, got, want)
    gen = r["samples"]["meshtrain_gen"]
    assert len(gen) == 5 and all(isinstance(s["resps"][0][0], str) for s in gen)
    assert r["results"]["meshtrain_gen"]["exact_match,strip"] == 1.0  # it learnt the answers, then "\n" ends them


def test_a_generation_stops_at_its_until_string(monkeypatch):
    """The sampler stops a row once its text holds an `until` string: the trained model answers " apple\n" and
    draws nothing after it (2 of max_gen_toks 16 draws), the same string as drawing all 16 and cutting."""
    import models.sampler as sampler
    from trainer.ckpt.params import load_params
    from trainer.config import model_config
    from trainer.run.harness import Tokenizer, _generate
    params, cfg = load_params(str(FIX))
    tok = Tokenizer(FIX / "tokenizer.json")
    lm = type("LM", (), {"c": model_config(cfg), "params": params, "tok": tok, "length": 256, "max_gen_toks": 256})()
    draws = []
    real = sampler.decode_step

    def counted(*a):
        step = real(*a)
        return lambda *b: (draws.append(1), step(*b))[1]
    monkeypatch.setattr(sampler, "decode_step", counted)
    kw = {"until": ["\n"], "max_gen_toks": 16, "do_sample": False}
    assert _generate(lm, ["Repeat the word: apple"], kw) == [" apple"]
    assert len(draws) < 16, len(draws)
    assert _generate(lm, ["Repeat the word: apple"], {**kw, "until": ["NEVER"]})[0].startswith(" apple\n")


def _same_as(samples_a, samples_b, where: str):
    """Every request of every task: the same arguments, log-likelihoods within 1e-4 (relative for rolling sums),
    the same is_greedy flags and generated strings."""
    assert set(samples_a) == set(samples_b), where
    for task in samples_b:
        a, b = sorted(samples_a[task], key=lambda x: x["doc_id"]), sorted(samples_b[task], key=lambda x: x["doc_id"])
        assert len(a) == len(b) > 0, task
        for x, y in zip(a, b):
            assert [list(v) for v in x["arguments"]] == [list(v) for v in y["arguments"]], (where, task)
            if task == "meshtrain_gen":
                assert x["resps"] == y["resps"], (where, task, x["resps"], y["resps"])
                continue
            for (p,), (q,) in zip(x["resps"], y["resps"]):  # (loglikelihood, is_greedy), or a rolling sum
                p, q = (p, True) if isinstance(p, (int, float)) else p, (q, True) if isinstance(q, (int, float)) else q
                assert abs(p[0] - q[0]) < 1e-4 * max(1.0, abs(q[0])) and bool(p[1]) == bool(q[1]), (where, task, p, q)


def _as_hflm(got: dict, fixture: str):
    want = json.loads((Path(__file__).parent / "fixtures" / "eval" / fixture).read_text())
    _same_as(got["samples"], want["samples"], f"meshtrain vs HFLM ({fixture})")
    for task, scores in want["results"].items():
        for k, v in scores.items():
            if k != "sample_len":
                assert abs(got["results"][task][k] - v) <= 1e-4 * max(1.0, abs(v)), (task, k)


def test_every_request_is_what_lm_eval_s_hf_backend_computes(one_device):
    """lm-eval 0.4.13's own HFLM (transformers + torch, float32) on the same folder and tasks at max_length 64 (the
    fixture of scripts/make_eval_fixture.py, which asserts that the rolling documents span several windows and that
    a generation context is cut on the left): every request's log-likelihood, is_greedy, rolling sum and generated
    string, and every score."""
    _as_hflm(one_device, "llama_64.json")


@pytest.mark.slow
def test_at_the_model_s_own_context_too():
    """The same at the folder's own context (max_position_embeddings 256, HFLM's default max_length)."""
    from trainer.run.harness import evaluate
    _as_hflm(evaluate(str(FIX), TASKS, ["mesh.data=1"], log_samples=True), "llama.json")


@pytest.mark.slow
def test_another_layout_scores_the_same(one_device):
    """(2,1,4): every request's figure within 1e-4 (relative for the rolling sums) and the same generations, and
    HFLM's."""
    from trainer.run.harness import evaluate
    eight = evaluate(str(FIX), TASKS, ["mesh.data=2", "mesh.model=4"], log_samples=True, max_length=64)
    _same_as(eight["samples"], one_device["samples"], "(2,1,4) vs one device")
    _as_hflm(eight, "llama_64.json")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["mesh.data=1"], ["mesh.data=2", "mesh.model=4"]], ids=["one", "2x1x4"])
def test_a_mixture_of_experts_scores_as_hflm(mesh):
    """The Mixtral fixture (experts routed by a router whose 2nd and 3rd logits differ by more than 1e-3 on every
    token lm-eval's requests route, asserted by the fixture script from the router's own outputs) on one device and
    on (2,1,4): every request and score as HFLM's."""
    from trainer.run.harness import evaluate
    _as_hflm(evaluate(str(MOE), TASKS, mesh, log_samples=True, max_length=64), "mixtral.json")


@pytest.mark.slow
def test_the_chat_template_renders_as_hflm_s():
    """--apply-chat-template: every request rendered through the folder's chat template (transformers'
    apply_chat_template as HFLM calls it) and scored as HFLM's, the multiple-choice and generation tasks."""
    from trainer.run.harness import evaluate
    got = evaluate(str(FIX), ["meshtrain_mc", "meshtrain_gen"], ["mesh.data=1"], log_samples=True,
                   apply_chat_template=True)
    assert got["samples"]["meshtrain_gen"][0]["arguments"][0][0].startswith("<|begin_of_text|><|im_start|>user")
    _as_hflm(got, "llama_chat.json")


def test_without_the_extra_it_is_one_line(monkeypatch):
    from trainer.run.harness import need_lm_eval
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)
    with pytest.raises(UserError, match=r"pip install 'meshtrain\[eval\]'") as e:
        need_lm_eval()
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_an_unknown_task_and_one_of_lm_eval_s_own_are_one_line():
    """A name that is not meshtrain's nor under --include-path is looked up in lm-eval's built-in tasks (indexing
    them takes ~15 s): unknown, or lm-eval's own whose data downloads from the hub."""
    from trainer.run.harness import task_configs
    with pytest.raises(UserError, match=r"^unknown task 'hellaswagg': not in meshtrain's tasks \(meshtrain_gen") as e:
        task_configs(["meshtrain_mc", "hellaswagg"])
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=r"^task 'hellaswag' is one of lm-eval's own and reads dataset_path "
                       r"'Rowan/hellaswag' from the Hugging Face hub, which nothing here reaches") as e:
        task_configs(["hellaswag"])
    assert "\n" not in str(e.value)


def test_data_that_is_not_local_is_one_line(tmp_path):
    from trainer.run.harness import task_configs
    (tmp_path / "hub.yaml").write_text("task: from_hub\ndataset_path: Rowan/hellaswag\noutput_type: multiple_choice\n")
    (tmp_path / "gone.yaml").write_text("task: gone\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                        "    test: missing.jsonl\noutput_type: multiple_choice\n")
    with pytest.raises(UserError, match=r"task from_hub .* reads dataset_path 'Rowan/hellaswag', which is not local"):
        task_configs(["from_hub"], [str(tmp_path)])
    with pytest.raises(UserError, match=r"task gone: its data file .*missing.jsonl is not there"):
        task_configs(["gone"], [str(tmp_path)])
    (tmp_path / "missing.jsonl").write_text(json.dumps({"q": 1}) + "\n")
    got = task_configs(["gone"], [str(tmp_path)])[0]  # a relative path is read beside its YAML, not in the cwd
    assert got["dataset_kwargs"]["data_files"]["test"] == str(tmp_path / "missing.jsonl")


TRAIN = [f"model.init_from={FIX}", "data.source=synthetic", "model.seq_len=64", "train.batch_size=8",
         "train.steps=2", "train.optimizer=sgd", "train.lr=0.5", "train.grad_clip=0", "train.warmup_steps=0",
         "train.eval_every=1", "checkpoint.every=2", "run.progress=false", f"eval.harness_tasks=[{','.join(TASKS)}]"]


def _logged(run: Path) -> dict:
    """step -> the harness scores metrics.jsonl logged at it."""
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "meshtrain_mc/acc" in r}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The fixture's Llama fine-tuned 2 SGD steps on (8,1,1), the three tasks scored at steps 1 and 2."""
    from trainer.cli import main
    run = tmp_path_factory.mktemp("harness") / "run"
    assert main(["train", *TRAIN, "mesh.data=-1", f"run.dir={run}"]) == 0
    return run


@pytest.mark.slow
def test_scores_during_training_are_meshtrain_eval_s_of_that_checkpoint(trained):
    """eval.harness_tasks in a run: the scores metrics.jsonl logs at step 2 equal `meshtrain eval` of the step-2
    checkpoint, and they moved from step 1's (the parameters changed)."""
    from trainer.run.benchmarks import scores
    from trainer.run.harness import evaluate
    logged = _logged(trained)
    assert sorted(logged) == [1, 2]
    want = scores(evaluate(str(trained), TASKS, ["mesh.data=-1"], step=2))
    assert want and {k: logged[2][k] for k in want} == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert logged[1]["meshtrain_rolling/bits_per_byte"] != logged[2]["meshtrain_rolling/bits_per_byte"]


def _two_processes(args: list[str], logs: Path):
    """`python -m trainer.cli ARGS` as 2 processes x 4 CPU devices (jax.distributed on localhost)."""
    import os
    import re
    import subprocess
    from test_multihost import ROOT, free_port
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=4")
    port, files = free_port(), [logs / f"{i}.log" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "trainer.cli", *args, f"dist.coordinator=127.0.0.1:{port}",
                               "dist.num_processes=2", f"dist.process_id={i}"],
                              cwd=ROOT, env=env, stdout=open(files[i], "w"), stderr=subprocess.STDOUT)
             for i in range(2)]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0], [f.read_text()[-2000:] for f in files]


@pytest.mark.slow
def test_two_processes_score_as_one(trained, tmp_path):
    """The same run as 2 processes x 4 devices: process 0 drives lm-eval and sends each batch of requests to
    process 1, which computes it with it; the scores logged at steps 1 and 2 equal 1 process x 8 devices'."""
    run = tmp_path / "run"
    _two_processes(["train", *TRAIN, "mesh.data=-1", f"run.dir={run}"], tmp_path)
    two, one = _logged(run), _logged(trained)
    assert sorted(two) == [1, 2]
    for step in (1, 2):
        keys = [k for k in one[step] if "/" in k and k.split("/")[0] in TASKS]
        assert keys and {k: two[step][k] for k in keys} == pytest.approx({k: one[step][k] for k in keys}, rel=1e-5)


@pytest.mark.slow
def test_meshtrain_eval_on_two_processes_is_hflm_s(tmp_path):
    """`meshtrain eval` as 2 processes x 4 devices on (2,1,4): process 0 writes lm-eval's results, every request as
    HFLM's."""
    out = tmp_path / "results.json"
    _two_processes(["eval", "--run", str(FIX), "--tasks", ",".join(TASKS), "--max-length", "64", "--log-samples",
                    "--output", str(out), "mesh.data=2", "mesh.model=4"], tmp_path)
    _as_hflm(json.loads(out.read_text()), "llama_64.json")


@pytest.mark.slow
def test_requests_of_60_lengths_compile_4_programs():
    """score_rows pads requests to length buckets (models/sampler.py `bucket`: 16, 32, 48, 64 here): 60 requests of
    60 different lengths (3 to 62 tokens) compile 4 programs (the jitted function's own cache count), and each
    figure equals the request scored alone at its own length (1e-5)."""
    import dataclasses
    from trainer.ckpt.params import load_params
    from trainer.config import model_config
    from trainer.run.harness import _scores_fn, score_rows
    params, cfg = load_params(str(FIX))
    c = dataclasses.replace(model_config(cfg), seq_len=200)  # a model config of its own: a fresh jit cache
    rng = np.random.default_rng(0)
    rows = [(list(rng.integers(1, 1000, n)), list(rng.integers(1, 1000, 1 + n % 3))) for n in range(3, 63)]
    got = score_rows(c, params, rows)
    assert _scores_fn(c)._cache_size() == 4
    for i in (0, 17, 59):  # alone: the last chunk of one row, padded to its own bucket
        alone = score_rows(c, params, [rows[i]])[0]
        assert abs(alone[0] - got[i][0]) < 1e-5 and alone[1] == got[i][1], i
