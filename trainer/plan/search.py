"""`meshtrain plan --search`: every valid layout for N devices, ranked by roofline step time."""
from __future__ import annotations

import dataclasses

from meshes import AXES, CONTEXT, DATA, EXPERT, MODEL, RULES, STAGE, shapes
from models import ModelConfig, family
from trainer.plan.core import Plan, Strategy, estimate
from trainer.plan.types import executed

CONTEXT_STRATEGIES = ("all_gather", "all_to_all", "ring")  # models/context_parallel/gather.py STRATEGIES, each where it can run

MICROBATCHES = (1, 2, 4, 8, 16, 32, 64)
REMATS = ("none", "dots", "full")


def strategies(mc: ModelConfig, batch: int, n_devices: int, repeats: int = 1, grad_sync: str = "auto",
               rules=RULES, balance: bool = True, context_attention: str = "all_gather"):
    """The layouts the trainer accepts on n_devices, each once as the trainer runs it (`executed`). `rules`: the
    run's rules, or a function of the data ranks giving them (None: the config cannot run on that many;
    trainer/state.py rules_by_data: a list, an MoE's experts split over `data` and replicated)."""
    return list(dict.fromkeys(map(executed, _candidates(mc, batch, n_devices, repeats, grad_sync, rules, balance,
                                                        context_attention))))


def _candidates(mc: ModelConfig, batch: int, n_devices: int, repeats: int, grad_sync: str, rules_of,
                balance: bool = True, context_attention: str = "all_gather"):
    """Every mesh shape x rules x schedule x ZeRO x microbatches x remat the trainer accepts, alike ones included."""
    widths = (mc.n_heads, mc.d_ff, mc.vocab_size)
    for shape in shapes(n_devices, [a.name for a in AXES]):  # every mesh axis; the first takes what the rest leave
        data, stage, model, context, expert = shape[DATA], shape[STAGE], shape[MODEL], shape[CONTEXT], shape[EXPERT]
        if expert > 1 and not callable(rules_of):  # the expert axis splits an MoE's experts: a config's rules
            continue
        # fewer kv heads than model ranks are replicated over the ranks that share one
        if any(w % model for w in widths) or (mc.n_kv_heads % model and model % mc.n_kv_heads):
            continue
        # context parallelism: whole chunks (two per rank, balanced), an MoE that can split its rows
        if context > 1 and (mc.seq_len % (2 * context if balance else context)
                            or family(mc.family).context_refusal(mc, context)):
            continue
        # under context parallelism each strategy whose heads split (all_to_all: over model x context)
        weighed = [a for a in CONTEXT_STRATEGIES if (a != "all_to_all" or mc.n_heads % (model * context) == 0)
                   and (a != "ring" or stage == 1 or context % 2 == 0)]  # trainer/config's checks
        # under tensor parallelism each rules twice: the residual stream whole along the sequence, and split over
        # `model` (train.sequence_parallel: less activation memory, more gathers; trainer/plan/split_residual.py)
        splits = (False, True) if model > 1 else (False,)
        for rules in [r.sequence(context, sp) for r in (rules_of(data, expert) if callable(rules_of) else [rules_of])
                      for sp in splits]:
            for schedule, v in _schedules(stage, repeats):
                if mc.n_layers % (stage * v):
                    continue
                for m in MICROBATCHES:
                    if batch % (data * expert * m) or (stage > 1 and m < stage):
                        continue
                    if schedule == "interleaved_1f1b" and m % stage:
                        continue
                    # ZeRO shards over the batch axes
                    for zero in (range(4) if data * expert * context > 1 else (0,)):
                        for remat in REMATS:
                            for ca in (weighed if context > 1 else [context_attention]):
                                yield Strategy(shape, zero, m, remat, v, grad_sync, schedule, rules, balance, ca)


def _schedules(stage: int, repeats: int) -> list[tuple[str, int]]:
    """(train.pipeline_schedule, V) pairs to try: GPipe at the configured V, 1F1B, and interleaved
    1F1B at the configured V (2 where it is 1)."""
    if stage == 1:
        return [("gpipe", 1)]
    return [("gpipe", repeats)] + ([("1f1b", 1)] if repeats == 1 else []) + [("interleaved_1f1b", max(repeats, 2))]


@dataclasses.dataclass(frozen=True)
class Ranked:
    plans: list  # the layouts that fit, fastest first
    rejected: int  # layouts that do not fit in memory
    tried: int
    smallest: Plan | None  # the least memory of all, for when nothing fits


def search(mc: ModelConfig, train, n_devices: int, device, hosts: int, dtype: str,
           platform: str | None = None, rules=RULES) -> Ranked:
    """Every layout of n_devices planned (on `platform`'s kernels, None: this host's), the fitting ones fastest
    first."""
    plans = [estimate(mc, train, st, device, hosts, dtype, platform)
             for st in strategies(mc, train.batch_size, n_devices, train.pipeline_repeats, train.grad_sync, rules,
                                  train.context_load_balance, train.context_attention)]
    fit = sorted((p for p in plans if p.fits), key=lambda p: (p.step_s, p.total_bytes))
    smallest = min(plans, key=lambda p: p.total_bytes) if plans else None
    return Ranked(fit, len(plans) - len(fit), len(plans), smallest)


def parts(p: Plan) -> dict:
    """Seconds of one step by cause: compute, bubble, and each mesh axis's communication."""
    out = {"compute": p.compute_s, "bubble": p.compute_s * p.bubble / (1 - p.bubble)}
    for axis, s in p.comm_s.items():
        link = "network" if any(p.links[a] == "net" for a in axis.split(",")) else "fast links"
        out[f"{axis} comm ({link})"] = s
    return out


def why(p: Plan, best: Plan, rank: int) -> str:
    """One line on what makes this layout fast or slow, against the fastest."""
    mine = parts(p)
    share = ", ".join(f"{k} {100 * v / p.step_s:.0f}%" for k, v in sorted(mine.items(), key=lambda kv: -kv[1])
                      if v / p.step_s >= 0.01)
    free = (p.device.hbm - p.total_bytes) / 1e9
    if rank == 0:
        lead = "fastest"
    else:
        theirs = parts(best)
        gaps = {k: mine.get(k, 0) - theirs.get(k, 0) for k in sorted(set(mine) | set(theirs))}  # sorted: no tie
        worst = max(gaps, key=gaps.get)  # is broken by the process's string hashing
        lead = f"+{100 * (p.step_s / best.step_s - 1):.1f}% vs #1, " + (f"mostly {worst}" if gaps[worst] > 0 else
                                                                          "no part slower")
    return f"{lead}: {share}; {free:.1f} GB free"
