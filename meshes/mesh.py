"""The one mesh factory: a mesh shape (meshes/axes.py) on devices -> jax.sharding.Mesh with explicit axis types;
the shipped presets (meshes/presets/)."""
from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from meshes.axes import AXES, MeshError, MeshShape, named, resolve

PRESET_DIR = Path(__file__).parent / "presets"


def build(shape: MeshShape, devices) -> Mesh:
    """The one mesh factory: `shape` (meshes/axes.py) on `devices`, its axis types explicit; an axis split over
    several hosts or slices (shape.dcn) makes a hybrid mesh."""
    devices = list(devices)
    names, sizes, dcn, axis_types = shape.names, shape.sizes, shape.dcn, shape.axis_types
    if math.prod(sizes) != len(devices):
        raise MeshError(f"mesh {shape.describe()} needs {math.prod(sizes)} devices, not {len(devices)}")
    if math.prod(dcn) > 1:
        from jax.experimental import mesh_utils
        ici = tuple(s // d for s, d in zip(sizes, dcn))
        # TPU slices carry slice_index; hosts of GPUs and CPUs do not: then each process is a granule
        slices = {getattr(d, "slice_index", None) for d in devices}
        by_process = None in slices or len(slices) != math.prod(dcn)
        granules = len({d.process_index for d in devices}) if by_process else len(slices)
        if granules != math.prod(dcn):
            kind = "processes" if by_process else "slices"
            split = " x ".join(f"mesh.dcn_{n}" for n, d in zip(names, dcn) if d > 1)
            raise MeshError(f"the hosts split {named([f'dcn_{n}' for n in names], dcn)} spans {math.prod(dcn)} hosts "
                            f"but the devices come from {granules} {kind}; make {split} equal {granules}")
        dev = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices, process_is_granule=by_process)
        return Mesh(dev, names, axis_types=axis_types)
    if len(devices) == len(jax.devices()) and devices == list(jax.devices()):
        return jax.make_mesh(sizes, names, axis_types=axis_types)
    if devices[0].platform == "tpu":  # a TPU topology compiled for ahead of time: laid out on its torus
        from jax.experimental import mesh_utils
        try:
            return Mesh(mesh_utils.create_device_mesh(sizes, devices=devices), names, axis_types=axis_types)
        except (ValueError, NotImplementedError, AssertionError):  # no torus-aligned layout of this shape
            pass
    return Mesh(np.asarray(devices).reshape(sizes), names, axis_types=axis_types)


def build_mesh(devices=None, **sizes: int) -> Mesh:
    """`build` of the shape that `sizes` (by axis name, e.g. data=2, model=4; an axis left out: its default) asks
    for on `devices` (default: all), on one host."""
    devices = list(jax.devices() if devices is None else devices)
    names = [a.name for a in AXES]
    if unknown := set(sizes) - set(names):
        raise MeshError(f"{sorted(unknown)} are not mesh axes ({', '.join(names)})")
    return build(resolve(sizes, len(devices)), devices)


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
