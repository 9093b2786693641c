"""What `meshtrain plan` prints: the plan as text or JSON, XLA's figures beside it, the search's ranking."""
from __future__ import annotations

import dataclasses

from meshes import DATA
from models import param_count
from trainer.plan.core import Plan
from trainer.plan.schedule_cost import cost
from trainer.plan.types import executed

GB = 1e9
LINK = {"fast": "fast link", "net": "network"}
TERMS = {"params_bytes": "parameters", "grads_bytes": "gradients", "opt_state_bytes": "optimizer state",
         "activations_bytes": "activations", "buffers_bytes": "buffers", "reference_bytes": "reference model",
         "sampling_bytes": "sampling KV cache (GRPO)"}
# The planner's figures that are XLA's own on every platform: the arguments, whose shapes and shardings come from
# the run's rules (within 0.1% of XLA:CPU's, and of XLA:TPU's where it pads no width to its tiles: docs/plan.md),
# the reference (DPO online, GRPO with beta > 0: the parameters again) and GRPO's sampling cache (its shapes)
EXACT = ("params_bytes", "opt_state_bytes", "reference_bytes", "sampling_bytes")
# Per platform: which figures are XLA's and which estimates (their error as measured, docs/plan.md), and where
# XLA's own are printed
FIGURES = {
    "cpu": "parameters, gradients and optimizer state are XLA:CPU's within 1.1%; activations and buffers are "
           "estimates (-75% to +21% of XLA:CPU's scratch at test shapes); --verify prints XLA's own",
    "tpu": "parameters and optimizer state are XLA:TPU's within 0.1% at widths of 128s (it pads narrower ones: -22% "
           "at d_model 64); gradients, activations and buffers are estimates (-79% to +409% of XLA:TPU's); "
           "--compile-for TOPOLOGY prints XLA:TPU's own",
    "gpu": "parameters and optimizer state are exact (their shapes); gradients, activations and buffers are "
           "estimates not measured against XLA:GPU; a run holds its compiled step's own figures",
}
FIXES = {"params_bytes": "train.zero_stage=3 or a larger mesh.model / mesh.stage",
         "grads_bytes": "train.zero_stage=2 or a larger mesh.model / mesh.stage",
         "opt_state_bytes": "train.zero_stage=1 (or higher) shards it over data",
         "activations_bytes": "model.remat=full, more train.microbatches, or a larger mesh.model",
         "buffers_bytes": "model.remat (ZeRO-3 keeps gathered weights without it) or fewer train.microbatches",
         "reference_bytes": "dpo.reference_mode=precompute (its log-probabilities computed once, stored beside the "
                            "data) for DPO, grpo.beta=0 for GRPO",
         "sampling_bytes": "fewer completions per step (train.batch_size), a shorter model.seq_len, or a larger "
                           "mesh.data / mesh.model"}


def _exact(platform: str) -> tuple:
    """The terms that are XLA's own on `platform` (on CPU the gradients too: the gradient function's outputs)."""
    return EXACT + (("grads_bytes",) if platform == "cpu" else ())


def size(b: float) -> str:
    """Bytes in the largest unit that keeps a digit before the point (GB = 10^9 bytes)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def memory_terms(p: Plan) -> dict:
    return {k: getattr(p, k) for k in TERMS}


def overflow(p: Plan) -> str | None:
    """Why a layout does not fit: by how much, and the term to cut first."""
    if p.fits:
        return None
    key, big = max(memory_terms(p).items(), key=lambda kv: kv[1])
    return (f"{p.strategy.describe()} does not fit: {p.total_bytes / GB:.1f} GB per device is "
            f"{(p.total_bytes - p.device.hbm) / GB:.1f} GB more than the {p.device.hbm / GB:.1f} GB of "
            f"{p.device.name}; the largest term is {TERMS[key]} ({big / GB:.1f} GB): try {FIXES[key]}")


def headline(p: Plan, n_params: int) -> str:
    mc = p.model
    count = f"{n_params / 1e9:.2f}B" if n_params >= 1e9 else f"{n_params / 1e6:.2f}M"
    return (f"{count} params (d={mc.d_model} L={mc.n_layers} H={mc.n_heads} KV={mc.n_kv_heads} "
            f"F={mc.d_ff} V={mc.vocab_size} T={mc.seq_len}) on {p.strategy.devices} x {p.device.name} "
            f"in {p.hosts} node(s) | batch {p.batch_size} x {mc.seq_len} tokens | {p.dtype} compute")


def as_json(p: Plan) -> dict:
    st = p.strategy
    return {
        "layout": {**st.mesh.as_dict(), "zero_stage": st.zero,
                   "microbatches": st.microbatches, "remat": st.remat, "pipeline_repeats": st.repeats,
                   "grad_sync": st.grad_sync, "pipeline_schedule": st.schedule,
                   "sequence_parallel": st.sequence_parallel,
                   **({"context_attention": st.context_attention} if st.context > 1 else {})},
        "device": p.device.name, "devices": st.devices, "hosts": p.hosts, "dtype": p.dtype,
        "params": param_count(p.model), "hbm_bytes": p.device.hbm,
        **memory_terms(p), "total_bytes": p.total_bytes, "fits": p.fits, "over_bytes": p.over_bytes,
        "full_finetune_state_bytes": p.full_state_bytes or None,
        "figures": {"exact": [k for k in TERMS if k in _exact(p.device.platform)],
                    "estimated": [k for k in TERMS if k not in _exact(p.device.platform)],
                    "accuracy": FIGURES[p.device.platform]},
        "comm_bytes": p.comm_bytes,
        "comm_bytes_by_axis": {a: p.axis_bytes(a) for a in sorted({t.axis for t in p.transfers})},
        "overflow_bytes": p.overflow_bytes,  # an MoE dispatch's exact path, only where a buffer overflows
        "transfers": [{"axis": t.axis, "kind": t.kind, "what": t.what, "bytes": t.bytes, "count": t.count,
                       "overflow": t.overflow} for t in p.transfers],
        "layer_residuals": {"fixed_bytes": p.layer_bytes[0], "bytes_per_token": p.layer_bytes[1]},
        "links": p.links, "bubble": p.bubble, "compute_s": p.compute_s, "comm_s": p.comm_s,
        "step_s": p.step_s, "tokens_per_step": p.tokens_per_step, "mfu": p.mfu,
    }


def text(p: Plan) -> str:
    st = p.strategy
    rows = [f"meshtrain plan: {headline(p, param_count(p.model))}",
            f"layout: {st.describe()} | grad_sync {st.grad_sync}", "",
            "memory per device"]
    for key, name in TERMS.items():
        if key in ("reference_bytes", "sampling_bytes") and not getattr(p, key):
            continue
        rows.append(f"  {name:<30}{size(getattr(p, key)):>12}")
        if key == "activations_bytes":
            fixed, per_token = p.layer_bytes
            remat = executed(st).remat
            rows.append(f"    one layer saves {size(per_token)} per token + {size(fixed)} (remat {remat})")
        if key == "sampling_bytes":
            rows.append("    held between steps, in place of the activations and buffers: the total counts the larger")
    verdict = f"fits, {size(p.device.hbm - p.total_bytes)} free" if p.fits else f"DOES NOT FIT, {size(p.over_bytes)} over"
    if p.full_state_bytes:  # a LoRA run: the frozen base holds no gradient or optimizer state
        rows.append(f"  {'  full fine-tuning would hold':<30}{size(p.full_state_bytes):>12}  as state (LoRA's: "
                    f"{p.state_bytes / p.full_state_bytes:.2f}x of it)")
    rows += [f"  {'total':<30}{size(p.total_bytes):>12}  of {size(p.device.hbm)} ({p.device.name}): {verdict}",
             f"  the planner's figures: {FIGURES[p.device.platform]}",
             "", "communication per step and device (bus bytes)",
             f"  {'axis':<18}{'link':<12}{'kind':<20}{'bytes':>10}  what"]
    for t in [t for t in p.transfers if not t.overflow]:
        link = "/".join(sorted({LINK[p.links[a]] for a in t.axis.split(",")}))
        rows.append(f"  {t.axis:<18}{link:<12}{t.kind:<20}{size(t.bytes):>10}  {t.what} (x{t.count})")
    rows.append(f"  {'total':<50}{size(p.comm_bytes):>10}")
    if apart := [t for t in p.transfers if t.overflow]:  # an MoE dispatch's exact path: not in the total
        rows.append("  only in a layer whose dispatch buffer overflows (moe/overflow), not in the total:")
        rows += [f"  {t.axis:<18}{'':<12}{t.kind:<20}{size(t.bytes):>10}  {t.what} (x{t.count})" for t in apart]
    if st.stage > 1:
        c = cost(st.schedule, st.stage, st.microbatches, st.repeats)
        rows.append(f"  pipeline {st.schedule} (S={st.stage} M={st.microbatches} V={st.repeats}): {c.ticks} ticks, "
                    f"bubble {100 * p.bubble:.1f}% (idle share of its table), {c.inputs} stage inputs live")
    comm = " + ".join(f"{a} {s:.4g} s" for a, s in p.comm_s.items()) or "none"
    rows += ["", "roofline step time (no overlap)",
             f"  compute {p.compute_s:.4g} s at {p.device.peak(p.dtype) / 1e12:.3g} TFLOP/s"
             + (f" / (1 - bubble {p.bubble:.2f})" if p.bubble else "") + f" + communication {comm}",
             f"  step {p.step_s:.4g} s | {p.tokens_per_step / p.step_s:,.0f} tokens/s | MFU {100 * p.mfu:.1f}%"]
    return "\n".join(rows)


def _row(name, a, b, width: int = 14, err: bool = True, label: int = 38) -> str:
    """One row of a prediction beside XLA's figure, with the relative error (n/a without one)."""
    err = f"{100 * (a / b - 1):+.1f}%" if b and err else "n/a"
    return f"  {name:<{label}}{a:>{width},.0f}{b:>{width},.0f}  {err}"


def verify_text(pred: Plan, m) -> str:
    """Prediction beside XLA's memory analysis and the HLO's collective bytes."""
    n = pred.strategy.devices
    rows = [f"XLA, compiled ahead of time for {n} simulated CPU devices ({pred.dtype}); bytes per device",
            f"  {'':<38}{'predicted':>14}{'XLA':>14}  error",
            _row("parameters + optimizer state", pred.params_bytes + pred.opt_state_bytes, m.params_opt_bytes),
            _row("gradients", pred.grads_bytes, m.grads_bytes),
            _row("parameters + optimizer + gradients", pred.state_bytes, m.params_opt_bytes + m.grads_bytes),
            _row("temp: activations+gradients+buffers", pred.activations_bytes + pred.grads_bytes + pred.buffers_bytes,
                 m.temp_bytes)]
    for axis, (mine, xla) in by_axis(pred, m).items():
        rows.append(_row(f"collectives over {axis}", mine, xla))
    rows.append(_row("collectives, total", pred.comm_bytes, m.comm_bytes))
    return "\n".join(rows)


def by_axis(pred: Plan, m) -> dict:
    """{mesh axis: (predicted, HLO) bytes}; a collective over several axes counts under each of them (an MoE
    dispatch's exact path apart on both sides)."""
    moves = [t for t in pred.transfers if not t.overflow]
    axes = sorted({a for t in moves for a in t.axis.split(",")} | {a for _, g in m.collectives for a in g})
    return {a: (sum(t.bytes for t in moves if a in t.axis.split(",")), m.axis_bytes(a)) for a in axes}


def _schedule(st) -> str:
    """The search table's schedule column: '-' without a pipeline."""
    if st.stage == 1:
        return "-"
    return st.schedule + (f" V={st.repeats}" if st.repeats > 1 else "")


def search_text(ranked, best_n: int, why) -> str:
    fit = ranked.plans
    if not fit:
        return ""
    p0 = fit[0]
    ep = any(p.strategy.rules["experts"] == DATA for p in fit)  # an EP column (expert parallelism) where tried
    cp = any(p.strategy.context > 1 for p in fit[:best_n])  # the context attention's column where a row has context
    sp = any(p.strategy.model > 1 for p in fit[:best_n])  # sequence parallelism's column where a row has `model`
    rows = [f"meshtrain plan --search: {headline(p0, param_count(p0.model))}",
            f"{ranked.tried} layouts tried, {len(fit)} fit in {p0.device.hbm / GB:.1f} GB; "
            f"the fastest {min(best_n, len(fit))} by roofline step time:",
            "   #" + "".join(f" {a:>5}" for a in p0.strategy.mesh.names)
            + " ZeRO    M remat schedule          step s   MFU  mem GB  comm GB" + (" EP" if ep else "")
            + (" SP" if sp else "") + (" attention" if cp else "")]
    for i, p in enumerate(fit[:best_n]):
        st = p.strategy
        rows.append(f"  {i + 1:>2}" + "".join(f" {n:>5}" for n in st.mesh.sizes)
                    + f" {st.zero:>4} {st.microbatches:>4} {st.remat:<5} {_schedule(st):<16} {p.step_s:>8.4g} "
                    f"{100 * p.mfu:>4.0f}% {p.total_bytes / GB:>7.1f} {p.comm_bytes / GB:>8.3f}"
                    + ((" on" if st.rules["experts"] == DATA else " off") if ep else "")
                    + ((" on" if st.sequence_parallel else " off") if sp else "")
                    + ((f" {st.context_attention}" if st.context > 1 else " -") if cp else ""))
        rows.append(f"       {why(p, p0, i)}")
    if any(p.strategy.stage > 1 for p in fit[:best_n]):
        rows.append("a pipeline recomputes each stage body whole for its backward: remat none, dots and full run "
                    "alike there, one row (none)")
    return "\n".join(rows)


def compiled_text(c) -> str:
    """`plan --compile-for`: XLA:TPU's figures per chip beside the planner's (trainer/plan/aot.py)."""
    p, m = c.plan, c.measured
    def row(name, a, b, err=True):
        return _row(name, a, b, width=19, err=err, label=40)
    n = p.strategy.devices
    planned_flops = p.compute_s * p.device.peak(p.dtype)  # per device, the planner's hardware FLOPs
    rows = [f"meshtrain plan --compile-for {c.topology}: {headline(p, param_count(p.model))}",
            f"layout: {p.strategy.describe()} | grad_sync {p.strategy.grad_sync}",
            f"XLA:TPU compiled the train step{' and the sampler' if c.sampler else ''} for {n} x {c.device_kind} "
            f"in {c.seconds:.1f} s here "
            f"(nothing ran); bytes per chip", f"  {'':<40}{'planner':>19}{'XLA:TPU':>19}  error",
            row("parameters + optimizer state", p.params_bytes + p.opt_state_bytes, m.params_opt_bytes),
            row("temp: activations+gradients+buffers", p.activations_bytes + p.grads_bytes + p.buffers_bytes,
                m.temp_bytes),
            row("total (arguments+temp+unaliased outputs)", p.total_bytes, c.total_bytes),
            *([row("  the train step's", p.state_bytes + p.activations_bytes + p.buffers_bytes + p.reference_bytes,
                   m.total_bytes),
               row("  sampling (GRPO): KV cache", p.sampling_bytes, max(f.alias_bytes for f in c.sampler.values())),
               row("  sampling: step + optimizer + reference", p.state_bytes - p.grads_bytes + p.sampling_bytes
                   + p.reference_bytes, c.sampling_bytes)] if c.sampler else []),
            f"  {'of the chip':<40}{size(p.device.hbm):>19}{'':>19}  ({p.device.name}"
            + (", fits)" if c.total_bytes <= p.device.hbm else ", DOES NOT FIT)")]
    for axis, (mine, xla) in by_axis(p, m).items():
        rows.append(row(f"collectives over {axis}", mine, xla))
    rows.append(row("collectives, total", p.comm_bytes, m.comm_bytes))
    if m.flops is not None:  # XLA's cost analysis counts a loop's body once, whatever its trips
        loops = " while(" in m.text
        rows.append(row("FLOPs per chip" + (" (XLA: loop bodies once)" if loops else ""), planned_flops, m.flops,
                        err=not loops))
    rows += ["", "collectives in XLA:TPU's program (bytes one chip sends per step)"]
    rows += [f"  {kind:<20}{','.join(axes) or '-':<14}{b:>19,.0f}" for (kind, axes), b in sorted(m.collectives.items())]
    if m.overflow:
        rows.append("  only where an MoE dispatch buffer overflows (its exact path), not in the total:")
        rows += [f"  {kind:<20}{','.join(axes) or '-':<14}{b:>19,.0f}" for (kind, axes), b in sorted(m.overflow.items())]
    return "\n".join(rows)


def compiled_json(c) -> dict:
    m = c.measured
    return {"topology": c.topology, "device_kind": c.device_kind, "compile_s": c.seconds,
            "predicted": as_json(c.plan),
            "xla_tpu": {"params_opt_bytes": m.params_opt_bytes, "temp_bytes": m.temp_bytes,
                        "argument_bytes": m.argument_bytes, "output_bytes": m.output_bytes,
                        "alias_bytes": m.alias_bytes, "total_bytes": c.total_bytes, "flops": m.flops,
                        "comm_bytes": m.comm_bytes, "fits": c.total_bytes <= c.plan.device.hbm,
                        "step_total_bytes": m.total_bytes,
                        "sampler": c.sampler and {k: {**dataclasses.asdict(f), "total_bytes": f.total_bytes}
                                                  for k, f in c.sampler.items()},
                        "sampling_total_bytes": c.sampling_bytes or None,
                        "collectives": [{"kind": k, "axes": list(a), "bytes": b}
                                        for (k, a), b in sorted(m.collectives.items())],
                        # an MoE dispatch's exact path, only where a buffer overflows (as if it ran)
                        "overflow_bytes": sum(m.overflow.values()),
                        "overflow_collectives": [{"kind": k, "axes": list(a), "bytes": b}
                                                 for (k, a), b in sorted(m.overflow.items())]}}


def lowered_text(low) -> str:
    """`plan --lower cuda`: what the StableHLO for CUDA holds (trainer/plan/aot.py)."""
    shape = " x ".join(f"{a} {n}" for a, n in low.mesh_shape.items())
    rows = [f"meshtrain plan --lower cuda: the train step lowered for {low.devices} CUDA devices ({shape}) "
            f"in {low.seconds:.1f} s; nothing was compiled",
            "explicit collectives in the lowered program (ops, a loop's body once; XLA:GPU's partitioner "
            "adds the ones the shardings imply when it compiles):"]
    rows += [f"  {kind:<20}{','.join(axes) or '-':<14}{count:>6}" for (kind, axes), count in low.collectives.items()]
    if not low.collectives:
        rows.append("  none: every collective of this layout is left to XLA:GPU's partitioner")
    line = f"attention: {low.attention}"
    if low.fallback:
        line += f" (XLA's attention in place of cuDNN's fused kernel, which does not lower here: {low.fallback})"
    rows.append(line)
    return "\n".join(rows)


def lowered_json(low) -> dict:
    return {"platform": "cuda", "devices": low.devices, "mesh": low.mesh_shape, "attention": low.attention,
            "cudnn_fallback": low.fallback, "lower_s": low.seconds,
            "collectives": [{"kind": k, "axes": list(a), "ops": n} for (k, a), n in low.collectives.items()]}
