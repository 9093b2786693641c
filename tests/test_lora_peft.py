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

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q_proj,v_proj,o_proj,down_proj]"]
ONE = ["mesh.data=1", "mesh.stage=1", "mesh.model=1"]


def _logits(over, ref, mesh=ONE):
    """The logits of the reference tokens and of the long prompt's last 8, from one forward of both (the short rows
    zero-padded at the end: attention is causal), under the config `over` (its parameters as init_params reads them)
    on the layout `mesh`."""
    from models.transformer import forward
    from trainer import load_config, resolve
    from trainer.ckpt.params import init_params
    from trainer.state import make_setup
    cfg = resolve(load_config(TINY + mesh + ["train.batch_size=4", "model.seq_len=420", *over]))
    s = make_setup(cfg, jax.devices()[:int(np.prod([cfg.mesh.data, cfg.mesh.stage, cfg.mesh.model]))])
    params = init_params(s, cfg.model.init_from)
    long, T = ref["long_prompt"], ref["tokens"].shape[1]
    rows = np.zeros((3, long.shape[1]), np.int32)
    rows[:2, :T], rows[2] = ref["tokens"], long[0]
    with jax.set_mesh(s.mesh):
        got = np.asarray(jax.jit(lambda p, t: forward(s.model, p, t))(params, rows))
    return got[:2, :T], got[2, -8:]


@pytest.mark.parametrize("name", ["peft_r4", pytest.param("peft_r4_rslora", marks=pytest.mark.slow),
                                  pytest.param("peft_r4_lm_head", marks=pytest.mark.slow)])
def test_an_adapter_peft_made_gives_peft_logits(name):
    """peft's adapter (B non-zero; with rsLoRA; with modules_to_save, their copies moved) read by model.lora.init_from:
    peft's logits (1e-4)."""
    ref = np.load(FIX / name / "reference.npz")
    rs = ["model.lora.use_rslora=true"] if "rslora" in name else []
    rs += ["model.lora.modules=[lm_head,embed_tokens]"] if "lm_head" in name else []
    short, long = _logits([f"model.init_from={FIX / 'llama_base'}", *LORA, *rs,
                           f"model.lora.init_from={FIX / name}"], ref)
    assert float(ref["moved"]) > 1e-2
    assert np.abs(short - ref["logits"]).max() < 1e-4 and np.abs(long - ref["long_logits"]).max() < 1e-4


EXPERT_TARGETS = ",mlp.experts.gate_up_proj,mlp.experts.down_proj"


@pytest.mark.slow  # MoE parity is -m slow (the share of the default suite: the Llama round trip, a layout, DPO)
@pytest.mark.parametrize("name", ["peft_mixtral_r4", "peft_mixtral_experts_r4", "peft_mixtral_fused_r4"])
def test_an_moe_adapter_with_the_experts_split_gives_peft_logits(name):
    """peft's adapter on the attention of a Mixtral (4 experts, k 2; and on its packed experts, peft's
    target_parameters, one A shared by gate and up; and with gate_up's at twice the rank and alpha, peft's
    rank_pattern/alpha_pattern of w1 and w3 fused), read into (2,1,4) ZeRO-3 with the experts split over data:
    peft's logits (1e-4)."""
    ref = np.load(FIX / name / "reference.npz")
    ep = ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3", "train.expert_parallel=true"]
    experts = EXPERT_TARGETS if "experts" in name or "fused" in name else ""
    short, long = _logits([f"model.init_from={Path(__file__).parent / 'fixtures' / 'hf' / 'mixtral_e4k2_f32'}",
                           "model.lora.rank=4", "model.lora.alpha=8",
                           f"model.lora.targets=[q_proj,k_proj,v_proj,o_proj{experts}]",
                           f"model.lora.init_from={FIX / name}"]
                          + (["model.lora.fused_gate_up=true"] if "fused" in name else []), ref, ep)
    assert float(ref["moved"]) > 1e-2
    assert np.abs(short - ref["logits"]).max() < 1e-4 and np.abs(long - ref["long_logits"]).max() < 1e-4


TRAINED = {"trained": (FIX / "llama_base", LORA, ONE),
           "trained_mixtral": (Path(__file__).parent / "fixtures" / "hf" / "mixtral_e4k2_f32",
                               ["model.lora.rank=4", "model.lora.alpha=8",
                                "model.lora.targets=[q_proj,k_proj,v_proj,o_proj,mlp.experts.gate_up_proj,"
                                "mlp.experts.down_proj]"],
                               ["mesh.data=2", "mesh.stage=1", "mesh.model=4", "train.zero_stage=3",
                                "train.expert_parallel=true"])}


@pytest.mark.parametrize("name", ["trained", pytest.param("trained_mixtral", marks=pytest.mark.slow)])
def test_a_trained_adapter_exports_to_peft_and_merged(tmp_path, capsys, name):
    """The fixture's run trained again (its command.json: 3 SGD steps on (2,1,4) ZeRO-3; the Mixtral's with the
    experts split over data) and exported: peft's logits of the export equal meshtrain's of it (1e-4), moved more than
    1e-2 from the base's; the export's tensors are the fixture's names; the merged export gives them too. The run's
    checkpoint holds the adapters, its base by reference (read again for the exports); a base changed or moved
    since stops the resume in one line, the checkpoint left as it was."""
    import shutil
    from hf_check import cli, read_folder
    from trainer.ckpt.store import list_steps, read_meta
    base, lora, mesh = TRAINED[name]
    run, adapter = tmp_path / "run", tmp_path / "adapter"
    command = json.loads((FIX / name / "command.json").read_text())
    base = Path(shutil.copytree(base, tmp_path / "base"))
    assert cli("train", f"model.init_from={base}", f"run.dir={run}", *command) == 0
    meta = read_meta(run, 3)
    assert "params.layers.wq_lora_a" in meta["leaves"] and "params.layers.wq" not in meta["leaves"]
    assert "params.layers.wq" in meta["base"]["leaves"] and meta["base"]["init_from"] == str(base)
    assert cli("export", "--run", str(run), "--format", "peft", "--out", str(adapter)) == 0
    ref = np.load(FIX / name / "reference.npz")
    short, long = _logits([f"model.init_from={base}", *lora, f"model.lora.init_from={adapter}"], ref, mesh)
    stored = np.load(base / "reference.npz")  # the base's logits of the same tokens, where its fixture holds them
    unmoved = stored["logits"] if np.array_equal(stored["tokens"], ref["tokens"]) else \
        _logits([f"model.init_from={base}"], ref, mesh)[0]
    assert float(ref["moved"]) > 1e-2 and np.abs(short - unmoved).max() > 1e-2  # the adapter moved them
    assert np.abs(short - ref["logits"]).max() < 1e-4 and np.abs(long - ref["long_logits"]).max() < 1e-4
    got, want = read_folder(adapter), read_folder(FIX / name / "adapter")
    assert sorted(got) == sorted(want)
    assert cli("export", "--run", str(run), "--format", "hf", "--merge", "--out", str(tmp_path / "merged")) == 0
    short, long = _logits([f"model.init_from={tmp_path / 'merged'}"], ref, mesh)
    assert np.abs(short - ref["merged_logits"]).max() < 1e-4
    assert np.abs(long - ref["merged_long_logits"]).max() < 1e-4
    weights = base / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10  # one bit of the last tensor's last value
    weights.write_bytes(bytes(data))
    more = [c for c in command if not c.startswith("train.steps=")] + ["train.steps=4"]
    capsys.readouterr()
    assert cli("train", f"model.init_from={base}", f"run.dir={run}", *more) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not the one its adapters were trained on" in err, err
    base.rename(tmp_path / "moved")
    assert cli("train", f"model.init_from={base}", f"run.dir={run}", *more) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"model.init_from={base} does not exist (moved or deleted?)" in err, err
    assert list_steps(run) == [3]


def test_dpo_with_lora_equals_trl(tmp_path):
    """TRL's DPOTrainer with a seeded LoraConfig (tests/fixtures/dpo_lora: scripts/make_dpo_lora_fixture.py), its
    initial adapter (A random, B zero) read by model.lora.init_from, the reference the base (the adapters off:
    with B zero, the policy at step 0), SGD at a constant rate, no clipping, every pair in each step: the second step's
    loss, rewards/* and logps/* within 1e-5 (the first is ln 2 and zero rewards whatever the implementation)."""
    from hf_check import cli
    from trainer.ckpt.initial import initial_state
    from trainer.ckpt.sources import resolve
    from trainer.config import load_config
    from trainer.data.batches import Batches, load_corpus
    from trainer.run import reference
    from trainer.state import make_setup
    from trainer.step import jit_train_step
    dpo = Path(__file__).parent / "fixtures" / "dpo"
    ref = json.loads((FIX.parent / "dpo_lora" / "reference.json").read_text())
    dref = json.loads((dpo / "reference.json").read_text())
    data = tmp_path / "pairs.bin"
    assert cli("prepare", str(dpo / "pairs_text.jsonl"), "--out", str(data), "--tokenizer", str(dpo / "policy"),
               "--no-progress", "--max-length", str(dref["max_length"]), "--heldout", "0") == 0
    n = len(dref["text"]["tokens"])
    cfg = resolve(load_config([f"data.source={data}", f"model.init_from={dpo / 'policy'}", "train.objective=dpo",
                               f"dpo.beta={dref['beta']}", f"train.batch_size={n}", "mesh.data=1", "train.optimizer=sgd",
                               f"train.lr={ref['lr']}", "train.warmup_steps=0", "train.grad_clip=0",
                               "train.weight_decay=0", f"model.lora.rank={ref['rank']}", f"model.lora.alpha={ref['alpha']}",
                               f"model.lora.targets=[{','.join(ref['targets'])}]",
                               f"model.lora.init_from={FIX.parent / 'dpo_lora' / 'initial_adapter'}"]))
    s = make_setup(cfg, jax.devices()[:1])
    host = Batches(load_corpus(cfg.data.source), 0, n, s.model.seq_len, s.model.vocab_size, evaluates=False,
                   document_mask=True).global_train(0)  # every pair, each step (TRL: one batch per epoch)
    batch, state, step = jax.device_put(host, s.batch_sharding()), initial_state(s), jit_train_step(s)
    with jax.set_mesh(s.mesh):
        batch["ref_logp"] = reference.logp_fn(s)(reference.load(s, lambda _: None), batch)
        got = []
        for _ in ref["steps"]:
            state, m = step(state, batch)
            got.append({k: float(v) for k, v in m.items() if np.ndim(v) == 0})
    want = ref["steps"][1]
    assert abs(want["loss"] - ref["steps"][0]["loss"]) > 1e-3  # the step moved the policy
    keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
    print("second step, largest difference from TRL relative to max(|TRL's|, 1):",
          max(abs(got[1][k] - want[k]) / max(abs(want[k]), 1.0) for k in keys), {k: got[1][k] for k in keys})
    for k in keys:
        assert abs(got[1][k] - want[k]) <= 1e-5 * max(abs(want[k]), 1.0), (k, got[1][k], want[k])


@pytest.mark.slow
def test_sft_with_lora_on_conversations_learns_and_exports(tmp_path):
    """LoRA (rank 8, every projection, the tied embedding trained whole) on the generate fixture's Llama, trained 20
    steps on the chat fixture's conversations (their assistant turns only; tests/fixtures/peft/sft/command.json): the
    last logged loss below the first by more than 0.5 nats; the run's logits are peft's of the fixture's export of the
    same run (1e-4: the head is the trained embedding, peft's ensure_weight_tying), its own export read back by
    model.lora.init_from gives them (1e-5), and the fixture's adapter read by meshtrain gives peft's logits (1e-4)."""
    from hf_check import cli
    from models.transformer import forward
    from trainer import load_config, resolve
    from trainer.ckpt.params import init_params, load_params_at
    from trainer.state import make_setup
    gen, chats = Path(__file__).parent / "fixtures" / "generate", Path(__file__).parent / "fixtures" / "chat"
    data, run = tmp_path / "chats.bin", tmp_path / "run"
    assert cli("prepare", str(chats / "conversations.jsonl"), "--out", str(data), "--tokenizer", str(gen),
               "--no-progress", "--heldout", "0") == 0
    command = json.loads((FIX / "sft" / "command.json").read_text())
    assert cli("train", f"data.source={data}", f"model.init_from={gen}", f"run.dir={run}", *command) == 0
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line and '"step"' in line]
    assert losses[0] - losses[-1] > 0.5, losses
    assert cli("export", "--run", str(run), "--format", "peft", "--out", str(tmp_path / "adapter")) == 0
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["ensure_weight_tying"] is True
    ref = np.load(FIX / "sft" / "reference.npz")
    lora = [c for c in command if c.startswith("model.lora.")]

    def logits(params, adapter=None):
        cfg = resolve(load_config([f"model.init_from={gen}", "model.seq_len=128", "mesh.data=1", *lora]
                                  + ([f"model.lora.init_from={adapter}"] if adapter else [])))
        s = make_setup(cfg, jax.devices()[:1])
        p = init_params(s, cfg.model.init_from) if adapter else jax.device_get(params)
        return np.asarray(jax.jit(lambda p: forward(s.model, p, ref["tokens"]))(p))
    ran = logits(load_params_at(run)[0])
    assert np.abs(ran - ref["logits"]).max() < 1e-4
    assert np.abs(logits(None, tmp_path / "adapter") - ran).max() < 1e-5
    assert np.abs(logits(None, FIX / "sft" / "adapter") - ref["logits"]).max() < 1e-4


@pytest.mark.parametrize("key,value", [("use_dora", True), ("lora_bias", True), ("layers_to_transform", [0]),
                                       ("trainable_token_indices", [5]), ("rank_pattern", {"q_proj": 8}),
                                       ("alpha_pattern", {"q_proj": 16}), ("r", 8), ("target_modules", ["q_proj"])])
def test_a_refused_adapter_setting_is_one_line(tmp_path, key, value):
    """An adapter_config.json setting meshtrain does not compute, or one that differs from model.lora's, stops the
    run in one line naming the key, before any weight is read."""
    import shutil
    from trainer.errors import UserError
    d = tmp_path / "adapter"
    shutil.copytree(FIX / "peft_r4", d)
    c = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**c, key: value}))
    with pytest.raises(UserError, match=rf"adapter_config.json: {key}=") as e:
        _logits([f"model.init_from={FIX / 'llama_base'}", *LORA, f"model.lora.init_from={d}"],
                np.load(FIX / "peft_r4" / "reference.npz"))
    assert "\n" not in str(e.value)


def test_a_tied_embedding_trained_apart_from_the_head_is_one_line(tmp_path):
    """peft's modules_to_save embed_tokens on a tied model without ensure_weight_tying trains the input embedding
    apart from the head (a model meshtrain's tied one cannot hold): refused in one line, from the config alone."""
    import shutil
    from trainer.ckpt.peft import check_config
    from trainer.config import load_config, model_config
    from trainer.errors import UserError
    d = Path(shutil.copytree(FIX / "sft" / "adapter", tmp_path / "adapter"))
    lora = [c for c in json.loads((FIX / "sft" / "command.json").read_text()) if c.startswith("model.lora.")]
    mc = model_config(load_config(["model.preset=tiny", "model.tie_embeddings=true", *lora]))
    c = check_config(d, mc)  # as meshtrain exported it (ensure_weight_tying): accepted
    (d / "adapter_config.json").write_text(json.dumps({**c, "ensure_weight_tying": False}))
    with pytest.raises(UserError, match=r"modules_to_save embed_tokens on a model with tied embeddings without "
                                        r"ensure_weight_tying") as e:
        check_config(d, mc)
    assert "\n" not in str(e.value)


def test_the_fused_gate_up_form_is_accepted_where_asked_for():
    """peft's gate_up_proj at twice the rank and alpha (rank_pattern/alpha_pattern, peft's fusion of w1 and w3) is
    read with model.lora.fused_gate_up=true (its logits: the MoE test above, -m slow), refused in one line without it;
    the key without those patterns in the adapter is refused too."""
    from trainer import load_config, resolve
    from trainer.ckpt.peft import check_config
    from trainer.config import model_config
    from trainer.errors import UserError
    mix = Path(__file__).parent / "fixtures" / "hf" / "mixtral_e4k2_f32"

    def mc(fused):
        return model_config(resolve(load_config([f"model.init_from={mix}", "model.lora.rank=4", "model.lora.alpha=8",
                                                 f"model.lora.targets=[q_proj,k_proj,v_proj,o_proj{EXPERT_TARGETS}]",
                                                 f"model.lora.fused_gate_up={str(fused).lower()}"])))
    assert check_config(FIX / "peft_mixtral_fused_r4", mc(True))["rank_pattern"] == {r".*\.gate_up_proj": 8}
    with pytest.raises(UserError, match=r"twice the rank and alpha \(peft's fusion of w1 and w3 adapters\); set "
                                        r"model.lora.fused_gate_up=true$"):
        check_config(FIX / "peft_mixtral_fused_r4", mc(False))
    with pytest.raises(UserError, match=r"has no rank_pattern \(and alpha_pattern\) of a fused gate_up_proj but "
                                        r"model.lora.fused_gate_up="
                                        r"true; set model.lora.fused_gate_up=false$"):
        check_config(FIX / "peft_mixtral_experts_r4", mc(True))


def test_an_adapter_of_other_shapes_is_one_line(tmp_path):
    """An adapter whose tensor does not fit the model's projection (another model's): one line naming the tensor."""
    import shutil
    from hf_check import read_st, write_st
    from trainer.errors import UserError
    d = tmp_path / "adapter"
    shutil.copytree(FIX / "peft_r4", d)
    tensors = {k: a for k, (_, a) in read_st(d / "adapter_model.safetensors").items()}
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[name] = tensors[name][:, :32].copy()  # another model's hidden width
    write_st(d / "adapter_model.safetensors", tensors)
    with pytest.raises(UserError, match=rf"'{name}' \[4, 32\] does not fit the model's") as e:
        _logits([f"model.init_from={FIX / 'llama_base'}", *LORA, f"model.lora.init_from={d}"],
                np.load(FIX / "peft_r4" / "reference.npz"))
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_a_resume_reads_the_base_again_and_continues_bit_for_bit(tmp_path):
    """The trained fixture's run saving every step; its last checkpoint removed (as if preempted after step 2's
    save), the run started again: it resumes from step 2, its base read from model.init_from and checked, and its
    step-3 adapters are the uninterrupted run's, bit for bit."""
    import shutil
    from hf_check import cli, read_folder
    command = [c for c in json.loads((FIX / "trained" / "command.json").read_text())
               if not c.startswith("checkpoint.every=")] + ["checkpoint.every=1"]
    run = tmp_path / "run"
    args = ("train", f"model.init_from={FIX / 'llama_base'}", f"run.dir={run}", *command)
    assert cli(*args) == 0
    assert cli("export", "--run", str(run), "--format", "peft", "--out", str(tmp_path / "straight")) == 0
    shutil.rmtree(run / "checkpoints" / "3")
    assert cli(*args) == 0
    assert cli("export", "--run", str(run), "--format", "peft", "--out", str(tmp_path / "resumed")) == 0
    straight, resumed = read_folder(tmp_path / "straight"), read_folder(tmp_path / "resumed")
    assert sorted(straight) == sorted(resumed)
    for k in straight:
        np.testing.assert_array_equal(resumed[k][1], straight[k][1], err_msg=k)
