"""`meshtrain plan [CONFIG.yaml ...] [key=value ...] [--json] [--verify] [--search] [--compile-for TOPOLOGY]
[--lower cuda] [--devices N] [--hosts H]`"""
from __future__ import annotations

import argparse
import json
import logging
import os

from trainer.errors import UserError

DESCRIPTION = """Per-device memory, communication per mesh axis and roofline step time of a layout,
from shapes alone: nothing is allocated and the planned devices need not exist. plan.device
(h100-80g, h200, a100-80g, tpu-v5p, tpu-v5e, tpu-v4, tpu-v6e, cpu, or the short h100, a100, v5p, v5e,
v4, v6e; default: this machine's) and
plan.hbm_gb choose the device. --verify compiles the real step for simulated CPU devices and
prints XLA's numbers beside the prediction; --search ranks every layout for --devices N.
--compile-for TOPOLOGY (e.g. v5p:4x4x8, v5e:4x4) compiles the train step ahead of time for that TPU
topology with libtpu and prints XLA:TPU's memory, collectives and FLOPs beside the plan; --lower cuda
lowers it for CUDA on an abstract mesh and lists its explicit collectives and kernel choices."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshtrain plan", description=DESCRIPTION, usage=__doc__.strip("`"))
    p.add_argument("--json", action="store_true", help="machine-readable output (bytes per device)")
    p.add_argument("--verify", action="store_true", help="compile the step and compare with XLA's figures")
    p.add_argument("--search", action="store_true", help="rank every valid layout for --devices")
    p.add_argument("--compile-for", metavar="TOPOLOGY", help="compile the step for a TPU topology (libtpu)")
    p.add_argument("--lower", metavar="PLATFORM", help="lower the step for a platform without compiling (cuda)")
    p.add_argument("--devices", type=int, help="devices to plan for (default: the mesh's product, or local)")
    p.add_argument("--hosts", type=int, help="nodes (GPU hosts, TPU slices) they span (default: fewest)")
    p.add_argument("--top", type=int, default=5, help="layouts --search prints (default: 5)")
    return p


def _local_device() -> str:
    import jax
    from trainer.hardware import from_kind
    row = from_kind(jax.devices()[0].device_kind)
    return row.name if row else "cpu"


def _n_devices(cfg, ns) -> int:
    from meshes import AXES, devices_named
    from trainer.config.schema import in_range
    from trainer.config.sections import SIZE
    named = devices_named(cfg.mesh)
    if ns.devices is not None or named is not None:
        sizes = " x ".join(f"{a.name}={getattr(cfg.mesh, a.name)}" for a in AXES)
        n, given = (ns.devices, f"--devices {ns.devices}") if ns.devices is not None else \
            (named, f"the mesh's {sizes} = {named} devices")
        if not in_range(n, SIZE):
            raise UserError(f"{given} must be {SIZE}; plan for fewer devices")
        return n
    import jax
    return jax.device_count()


def main(args: list[str]) -> int:
    ns, rest = _parser().parse_known_args(args)
    bad = [a for a in rest if a.startswith("-")]
    if bad:
        raise UserError(f"unknown option '{bad[0]}' for meshtrain plan; see `meshtrain plan --help`")
    from trainer.config import compute_dtype, load_config, model_config
    from trainer.ckpt.sources import resolve
    from trainer.data.checks import check_data
    cfg = resolve(load_config(rest))
    check_data(cfg)  # what the data decides, as `meshtrain train` says it (trainer/data/checks.py)
    modes = [f for f, on in (("--verify", ns.verify), ("--search", ns.search), ("--compile-for", ns.compile_for),
                             ("--lower", ns.lower)) if on]
    if len(modes) > 1:
        raise UserError(f"{' and '.join(modes)} do different things; give one of them per run")
    if ns.compile_for:
        return _compile_for(cfg, ns)
    n = _n_devices(cfg, ns)
    if ns.lower:
        return _lower(cfg, n, ns)
    if ns.verify and "device_count" not in os.environ.get("XLA_FLAGS", ""):
        # simulated CPU devices; read when jax starts its backend (if it already has, _verify says so)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from trainer.plan.core import estimate, strategy_of
    from trainer.hardware import get_device
    device = get_device(_local_device() if cfg.plan.device == "auto" else cfg.plan.device, cfg.plan.hbm_gb)
    hosts = ns.hosts or -(-n // device.node)
    if hosts < 1 or n % hosts:
        given = f"--hosts {hosts}" if ns.hosts else f"{hosts} nodes of {device.node} {device.name} devices"
        raise UserError(f"{given} must divide --devices {n}; give --hosts, a number of nodes that splits them evenly")
    mc = model_config(cfg)
    dtype = cfg.train.dtype or ("float32" if device.name == "cpu" else "bfloat16")
    if ns.search:
        return _search(mc, cfg, n, device, hosts, dtype, ns)
    plan = estimate(mc, cfg.train, strategy_of(cfg, n), device, hosts, dtype, device.platform)  # its kernels
    out = {"plan": plan}
    if ns.verify:
        out["verify"] = _verify(cfg, n, device, hosts, mc, compute_dtype(cfg, "cpu"))
    _print(out, ns.json)
    from trainer.plan.report import overflow
    problem = overflow(plan)
    if problem:
        logging.getLogger(__name__).error(problem)
        return 2
    return 0


def _compile_for(cfg, ns) -> int:
    from trainer.plan import report
    from trainer.plan.aot import compile_for, overflow
    c = compile_for(cfg, ns.compile_for)
    print(json.dumps(report.compiled_json(c), indent=1) if ns.json else report.compiled_text(c))
    problem = overflow(c)
    if problem:
        logging.getLogger(__name__).error(problem)
        return 2
    return 0


def _lower(cfg, n, ns) -> int:
    from trainer.plan import report
    from trainer.plan.aot import lower_cuda
    if ns.lower != "cuda":
        raise UserError(f"--lower {ns.lower}: only cuda is known; for TPU use --compile-for TOPOLOGY")
    low = lower_cuda(cfg, n)
    print(json.dumps(report.lowered_json(low), indent=1) if ns.json else report.lowered_text(low))
    return 0


def _verify(cfg, n, device, hosts, mc, dtype):
    import jax
    from trainer.plan.core import estimate, strategy_of
    from trainer.plan.verify import measure
    if jax.devices()[0].platform != "cpu" or jax.device_count() < n:
        raise UserError(f"--verify needs {n} simulated CPU devices but this process has {jax.device_count()} "
                        f"{jax.devices()[0].platform} device(s); run it in a fresh process with JAX_PLATFORMS=cpu")
    pred = estimate(mc, cfg.train, strategy_of(cfg, n), device, hosts, dtype, device.platform)
    return pred, measure(cfg, jax.devices()[:n])


def _print(out: dict, as_json: bool):
    from trainer.plan import report
    plan = out["plan"]
    if as_json:
        doc = report.as_json(plan)
        if "verify" in out:
            pred, m = out["verify"]
            doc["verify"] = {"predicted": report.as_json(pred), "xla": {
                "params_opt_bytes": m.params_opt_bytes, "grads_bytes": m.grads_bytes, "temp_bytes": m.temp_bytes,
                "argument_bytes": m.argument_bytes, "output_bytes": m.output_bytes, "alias_bytes": m.alias_bytes,
                "comm_bytes": m.comm_bytes,
                "collectives": [{"kind": k, "axes": list(a), "bytes": b} for (k, a), b in m.collectives.items()]}}
        print(json.dumps(doc, indent=1))
        return
    print(report.text(plan))
    if "verify" in out:
        print()
        print(report.verify_text(*out["verify"]))


def _search(mc, cfg, n, device, hosts, dtype, ns) -> int:
    from trainer.plan import report
    from trainer.plan.search import search, why
    from trainer.state import rules_by_data
    ranked = search(mc, cfg.train, n, device, hosts, dtype, device.platform, rules_by_data(cfg))
    if ns.json:
        doc = {"tried": ranked.tried, "fit": len(ranked.plans),
               "plans": [dict(report.as_json(p), why=why(p, ranked.plans[0], i))
                         for i, p in enumerate(ranked.plans[:ns.top])]}
        if not ranked.plans and ranked.smallest is not None:  # how far off the closest layout is
            doc["smallest"] = report.as_json(ranked.smallest)
        print(json.dumps(doc, indent=1))
    elif ranked.plans:
        print(report.search_text(ranked, ns.top, why))
    elif ranked.smallest is not None:
        print(f"nothing of {ranked.tried} layouts fits; the one needing the least memory:")
        print(report.text(ranked.smallest))
    if not ranked.plans:
        if ranked.smallest is None:
            raise UserError(f"no layout of {mc.n_layers} layers, {mc.n_heads} heads and batch {cfg.train.batch_size} "
                            f"splits over {n} devices; change --devices or train.batch_size")
        logging.getLogger(__name__).error(f"nothing fits; the smallest: {report.overflow(ranked.smallest)}")
        return 2
    return 0
