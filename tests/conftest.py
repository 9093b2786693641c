"""Every test runs on 8 simulated CPU devices, set before jax is imported."""
import importlib.metadata
import os

# LLVM at -O0: the tests' programs are tiny, so compiling is most of their time and -O0 halves it
# (tests/test_layouts.py: 36 s -> 19 s). HLO passes (fusion, sharding, buffer assignment) still run,
# so collectives and memory_analysis are what the real build gets; set the flag yourself to override.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
# jaxlib 0.10's XLA:CPU emits fusions through MLIR by default; its older elemental emitter compiles in about half
# the time (a ZeRO-3 (2,1,4) step: 2.2 s -> 1.2 s). The HLO keeps its collectives (the same all-gathers,
# reduce-scatters and all-reduces) and fuses a little less (temp bytes +0.006%). Later jaxlibs dropped the flag
# (and refuse unknown flags), so it is set on 0.10 only.
if "xla_cpu_use_fusion_emitters" not in _flags and importlib.metadata.version("jaxlib").startswith("0.10."):
    _flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, its xdist workers and the `meshtrain` processes tests start
# (they inherit the environment): a program compiled once (a train step a resume compiles again, a one-device
# reference another module runs) is read back, not compiled again. Keyed by the program and the flags.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshtrain-tests-xla-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")

import functools  # noqa: E402
from typing import NamedTuple  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

assert jax.device_count() == 8, "tests need 8 simulated CPU devices"

TINY = ["model.preset=tiny", "train.batch_size=16", "train.warmup_steps=1", "train.lr=1e-2",
        "train.steps=3", "run.progress=false"]


# Scale-sensitive settings for equivalence tests: AdamW with clipping is nearly invariant to a constant
# gradient scale (a missing 1/k or 1/m would pass), plain SGD without clipping is not.
SGD = ["train.optimizer=sgd", "train.grad_clip=0"]


class Run(NamedTuple):
    losses: np.ndarray
    params: dict
    setup: object
    state: dict
    grad_norms: np.ndarray


@functools.lru_cache(maxsize=None)
def corpus(source="builtin"):
    from trainer.data.batches import load_corpus
    return load_corpus(source)


def run_steps(overrides, n_devices=None, steps=3, source="builtin"):
    """Train `steps` steps in-process; return Run(losses, params as numpy, setup, state, grad norms).

    n_devices defaults to the mesh's product when every axis is given, else 8.
    """
    from meshes import devices_named
    from trainer.config import load_config
    from trainer.state import make_setup
    cfg = load_config(TINY + list(overrides))
    return train_setup(make_setup(cfg, jax.devices()[:n_devices or devices_named(cfg.mesh) or 8]), steps, source)


def train_setup(s, steps=3, source="builtin"):
    """Train `steps` steps of a setup from its initial state; return Run(losses, params as numpy, setup, state,
    grad norms)."""
    from trainer.data.batches import Batches
    from trainer.step import jit_train_step
    cfg = s.cfg
    state = fresh_state(s)
    step = jit_train_step(s)
    b = Batches(corpus(source), cfg.train.seed, cfg.train.batch_size, s.model.seq_len, s.model.vocab_size,
                document_mask=cfg.data.document_mask)
    losses, norms = [], []
    with jax.set_mesh(s.mesh):
        for i in range(steps):
            state, m = step(state, jax.device_put(b.global_train(i), s.batch_sharding()))
            losses.append(float(m["loss"]))
            norms.append(float(m["grad_norm"]))
    return Run(np.array(losses), jax.tree.map(np.asarray, state["params"]), s, state, np.array(norms))


_FRESH = {}


def fresh_state(s):
    """trainer.state.init_state(s), its values made once per model, seed, optimizer and state structure in this
    process and put into each layout's shardings: a layout changes where the state lives, not its values (jax's
    partitionable random bits), and init_state's own program (traced and compiled per layout, about 0.7 s) was a
    quarter of a layout test. tests/test_state_init.py checks init_state itself against this, layout by layout."""
    from trainer.state import init_state
    key = state_key(s)
    if key not in _FRESH:
        _FRESH[key] = jax.tree.map(np.asarray, init_state(s))
    with jax.set_mesh(s.mesh):
        return jax.device_put(_FRESH[key], s.shardings)


def state_key(s):
    """What a fresh state's values follow: the model, the seed, the optimizer and the state's leaves (their shapes
    and dtypes, in their tree); not the layout."""
    leaves, tree = jax.tree.flatten(jax.tree.map(lambda x: (x.shape, str(x.dtype)), s.shapes,
                                                 is_leaf=lambda x: hasattr(x, "shape")))
    return repr(s.model), s.cfg.train.seed, s.cfg.train.optimizer, repr(tree), repr(leaves)


def single_device(overrides, steps=3):
    """The 1-device reference run for the same model/train settings: (losses, params, grad norms)."""
    keep = [o for o in overrides if not o.startswith(("mesh.", "train.zero_stage", "train.grad_sync",
                                                      "train.pipeline_repeats", "train.pipeline_schedule"))]
    return _single(tuple(keep), steps)


@functools.lru_cache(maxsize=None)
def _single(overrides, steps):
    r = run_steps(list(overrides) + ["mesh.data=1", "mesh.stage=1", "mesh.model=1"], 1, steps)
    return r.losses, r.params, r.grad_norms


def equals_one_device(over, steps=3):
    """Train `over` and its 1-device run (the context strategy key dropped with the mesh) `steps` SGD steps: the
    losses and grad norms within 1e-5, every parameter within 1e-5 (max_rel); returns the layout's Run."""
    r = run_steps(over, steps=steps)
    losses, params, norms = single_device([o for o in over if not o.startswith("train.context_attention")], steps)
    np.testing.assert_allclose(r.losses, losses, rtol=1e-5)
    np.testing.assert_allclose(r.grad_norms, norms, rtol=1e-5)
    assert max_rel(r.params, params) < 1e-5
    return r, params


def max_rel(a_tree, b_tree):
    """Largest per-tensor relative difference ||a - b|| / ||b|| over a pytree."""
    pairs = zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree))
    return max(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)) for a, b in pairs)


@pytest.fixture
def tmp_run(tmp_path):
    return str(tmp_path / "run")


def prepare_documents(tmp) -> str:
    """A prepared file (`meshtrain prepare`, a trained 300-token BPE) of 12 documents of 20 to 185 words, in
    folder tmp: their lengths divide nothing."""
    from trainer.cli import main
    rng = np.random.default_rng(0)
    (tmp / "src").mkdir()
    for i in range(12):
        (tmp / "src" / f"d{i:02d}.txt").write_text(" ".join(f"w{i}_{w}" for w in rng.integers(0, 40, 20 + 15 * i)))
    out = tmp / "data.bin"
    assert main(["prepare", str(tmp / "src"), "--out", str(out), "--train-tokenizer", "300", "--no-progress"]) == 0
    return str(out)


@pytest.fixture(scope="module")
def s3():
    """An S3 endpoint on localhost for this module (AWS_ENDPOINT_URL and test credentials), bucket `bkt` made."""
    pytest.importorskip("s3fs")
    import socket

    from moto.server import ThreadedMotoServer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec keeps one per arguments: another module's, of another port
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.makedirs("bkt", exist_ok=True)  # moto's state is the process's: another module's server made it already
    yield fs
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    server.stop()


# Seconds each of the heaviest modules took in a full default run (two workers, 2-core host; rough, refreshed now and
# then). pytest-xdist hands whole files (--dist loadfile) to whichever worker is free, in collection order, so the
# heaviest go first (longest job first): a 70 s file collected last would keep one worker busy while the other
# idles. Only the order changes; a module missing here runs after these, in its usual order.
HEAVIEST = {"test_plan.py": 150, "test_checkpoint.py": 95, "test_moe.py": 62, "test_pipeline.py": 66,
            "test_context.py": 54, "test_multihost.py": 60, "test_hf.py": 57, "test_tpu_compile.py": 50,
            "test_family.py": 44, "test_watchdog.py": 43, "test_reliability.py": 41, "test_shards.py": 39,
            "test_expert_parallel.py": 35, "test_fast_paths.py": 34, "test_dpo.py": 36, "test_documents.py": 33,
            "test_loss_mean.py": 30, "test_pipeline_sync.py": 26, "test_localsgd.py": 28, "test_tiled_loss.py": 29,
            "test_chat.py": 27, "test_gemma.py": 27, "test_layouts.py": 26, "test_deepseek_train.py": 52,
            "test_expert_axis.py": 52, "test_moe_tpu.py": 30, "test_gpt_oss_train.py": 30, "test_eval.py": 25,
            "test_sequence_parallel.py": 25}


def pytest_collection_modifyitems(config, items):
    """The heaviest modules first (HEAVIEST; pyproject.toml's addopts turn off xdist's own order, by test count)."""
    items.sort(key=lambda item: -HEAVIEST.get(item.path.name, 0))  # stable: a module's tests keep their order
