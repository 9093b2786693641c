"""The one mesh factory: (data, stage, model) -> jax.sharding.Mesh with explicit axis types."""
from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "stage", "model")
PRESET_DIR = Path(__file__).parent / "presets"


class MeshError(ValueError):
    """A mesh shape that cannot be built on the devices at hand."""


def resolve_shape(data: int, stage: int, model: int, n_devices: int) -> tuple[int, int, int]:
    """Fill in the one -1 axis with the remaining devices and check the product."""
    shape = [data, stage, model]
    free = [i for i, s in enumerate(shape) if s == -1]
    if len(free) > 1:
        raise MeshError(f"mesh has {len(free)} axes set to -1 ({', '.join(AXES[i] for i in free)}); "
                        "set at most one axis to -1")
    for i, s in enumerate(shape):
        if s == 0 or s < -1:
            raise MeshError(f"mesh.{AXES[i]}={s} is not a positive size; use a positive int or -1")
    if free:
        rest = math.prod(s for s in shape if s != -1)
        if n_devices % rest:
            raise MeshError(f"mesh {tuple(shape)} cannot fill {n_devices} devices: {n_devices} is not "
                            f"divisible by {rest}; choose axis sizes whose product divides {n_devices}")
        shape[free[0]] = n_devices // rest
    if math.prod(shape) != n_devices:
        raise MeshError(f"mesh (data, stage, model)={tuple(shape)} has {math.prod(shape)} devices but "
                        f"{n_devices} are available; make the product {n_devices} or set one axis to -1")
    return tuple(shape)


def build_mesh(data: int = -1, stage: int = 1, model: int = 1, devices=None,
               dcn: tuple[int, int, int] | None = None) -> Mesh:
    """Build the (data, stage, model) mesh; `dcn` splits axes across hosts/slices (hybrid mesh)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_shape(data, stage, model, len(devices))
    axis_types = (AxisType.Auto,) * 3
    if dcn is not None and math.prod(dcn) > 1:
        from jax.experimental import mesh_utils
        if any(s % d for s, d in zip(shape, dcn)):
            raise MeshError(f"dcn {tuple(dcn)} does not divide the mesh {shape}; give each axis a dcn size dividing it")
        ici = tuple(s // d for s, d in zip(shape, dcn))
        # TPU slices carry slice_index; hosts of GPUs and CPUs do not: then each process is a granule
        slices = {getattr(d, "slice_index", None) for d in devices}
        by_process = None in slices or len(slices) != math.prod(dcn)
        granules = len({d.process_index for d in devices}) if by_process else len(slices)
        if granules != math.prod(dcn):
            kind = "processes" if by_process else "slices"
            raise MeshError(f"dcn {tuple(dcn)} spans {math.prod(dcn)} hosts but the devices come from {granules} "
                            f"{kind}; make mesh.dcn_data x mesh.dcn_stage equal {granules}")
        dev = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices, process_is_granule=by_process)
        return Mesh(dev, AXES, axis_types=axis_types)
    if len(devices) == len(jax.devices()) and devices == list(jax.devices()):
        return jax.make_mesh(shape, AXES, axis_types=axis_types)
    if devices[0].platform == "tpu":  # a TPU topology compiled for ahead of time: laid out on its torus
        from jax.experimental import mesh_utils
        try:
            return Mesh(mesh_utils.create_device_mesh(shape, devices=devices), AXES, axis_types=axis_types)
        except (ValueError, NotImplementedError, AssertionError):  # no torus-aligned layout of this shape
            pass
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=axis_types)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name: str) -> Path:
    """Path of a shipped mesh preset YAML."""
    path = PRESET_DIR / f"{name}.yaml"
    if not path.exists():
        import difflib
        near = difflib.get_close_matches(name, preset_names(), n=1)
        hint = f"did you mean '{near[0]}'?" if near else f"choose one of {', '.join(preset_names())}"
        raise MeshError(f"unknown mesh preset '{name}'; {hint}")
    return path
