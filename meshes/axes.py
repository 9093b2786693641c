"""The mesh axes, in mesh order, and a mesh's shape (its sizes by name): the one place that lists the axes.

Each axis's name is a constant here, DATA, STAGE, EXPERT, CONTEXT and MODEL, and AXES is built from them: code that names a
mesh axis (a PartitionSpec's entry, a collective's axis, a rules entry, a mesh's size by name, a planner transfer's
axis) imports the constant. A literal "data", "stage", "context" or "model" in such a place outside this file fails
tests/test_axes.py (its rules list the places).

Every other module asks here: a run's sizes by name (`MeshShape`, from the mesh.* keys: `shape_of`), its abstract
mesh and axis types, the hosts each axis is split over (DCN), the shape a checkpoint recorded (`recorded`: an axis
it lacks reads as 1) and the shapes n devices can take (`shapes`, the layout search). Adding an axis is an entry in
AXES (the config section makes its `mesh.NAME` key from it, trainer/config/sections.py) and, for what it splits, a rule
in meshes/rules.py.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Mapping, Sequence

from jax.sharding import AbstractMesh, AxisType


class MeshError(ValueError):
    """A mesh shape that cannot be built on the devices at hand."""


@dataclasses.dataclass(frozen=True)
class Axis:
    """One mesh axis: its name (the key `mesh.NAME`), that key's meaning and default, and, for an axis that may be
    split across hosts or slices (a hybrid mesh), the meaning of its key `mesh.dcn_NAME`."""
    name: str
    doc: str
    default: int = 1
    dcn: str | None = None

    @property
    def dcn_key(self) -> str:
        return f"dcn_{self.name}"


# The axes' names, imported wherever code names a mesh axis (meshes/rules.py maps the logical axes to them).
DATA, STAGE, EXPERT, CONTEXT, MODEL = "data", "stage", "expert", "context", "model"
# Mesh order: the last axis is innermost, on neighbouring devices (`model` all-reduces in every layer: the fastest
# links); the first takes what the others leave (-1).
AXES = (
    Axis(DATA, "devices the batch (and ZeRO's state) is split over; -1: the devices left", -1,
         "hosts/slices `data` is split over (hybrid mesh: `model` stays inside a host)"),
    Axis(STAGE, "pipeline stages, each holding n_layers / stage layers", dcn="hosts/slices `stage` is split over"),
    # an MoE's expert-parallel degree: the batch split over data x expert, an MoE layer's experts over `expert` alone,
    # its tokens sent to them by all-to-all every MoE layer (N x k x D each way): inside a host (no DCN split), on
    # the links inside `stage`'s
    Axis(EXPERT, "expert-parallel ranks: an MoE's experts split over them (n_experts / expert each), the batch "
         "split over data x expert, ZeRO's state too"),
    # inside `stage`, outside `model`: it all-gathers each layer's K/V (GQA: fewer bytes than `model`'s two
    # all-reduces of the activations per layer), so it takes the links next to model's
    Axis(CONTEXT, "ranks each sequence is split over (context parallelism): seq_len / context tokens of every "
         "row per device", dcn="hosts/slices `context` is split over"),
    Axis(MODEL, "tensor-parallel ranks splitting heads, MLP units and vocabulary"),
)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """A mesh's axis sizes by name, in mesh order, and the hosts (DCN) each axis is split over."""
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    dcn: tuple[int, ...]

    def __getitem__(self, name: str) -> int:
        if name not in self.names:
            raise KeyError(f"'{name}' is not a mesh axis ({', '.join(self.names)})")
        return self.sizes[self.names.index(name)]

    def items(self) -> list[tuple[str, int]]:
        return list(zip(self.names, self.sizes))

    def as_dict(self) -> dict[str, int]:
        return dict(self.items())

    @property
    def devices(self) -> int:
        return math.prod(self.sizes)

    @property
    def axis_types(self) -> tuple:
        """Auto on every axis: shardings flow from the jit boundaries and the rules' constraints."""
        return (AxisType.Auto,) * len(self.names)

    def abstract(self) -> AbstractMesh:
        """The mesh without devices (the planner's, and a compile for devices this host lacks)."""
        return AbstractMesh(self.sizes, self.names, axis_types=self.axis_types)

    def describe(self) -> str:
        """'data=2 stage=1 context=1 model=4'."""
        return named(self.names, self.sizes)

    def __str__(self) -> str:
        return "x".join(map(str, self.sizes))


def named(names: Sequence[str], sizes: Sequence[int]) -> str:
    """Sizes by axis name, as every mesh message writes them: 'data=-1 stage=1 context=3 model=1'."""
    return " ".join(f"{n}={s}" for n, s in zip(names, sizes))


def mesh_shape(sizes: Mapping[str, int], axes: Sequence[Axis] = AXES) -> MeshShape:
    """The shape of known sizes (an axis not named: 1), on one host."""
    names = tuple(a.name for a in axes)
    if unknown := set(sizes) - set(names):
        raise KeyError(f"{sorted(unknown)} are not mesh axes ({', '.join(names)})")
    return MeshShape(names, tuple(int(sizes.get(n, 1)) for n in names), (1,) * len(names))


def resolve(sizes: Mapping[str, int], n_devices: int, dcn: Mapping[str, int] | None = None,
            axes: Sequence[Axis] = AXES) -> MeshShape:
    """The shape `sizes` asks for on n devices (an axis not named: its default; the one -1: the devices left),
    each axis's DCN split (default 1) dividing it."""
    names = tuple(a.name for a in axes)
    shape = [int(sizes.get(a.name, a.default)) for a in axes]
    free = [i for i, s in enumerate(shape) if s == -1]
    if len(free) > 1:
        raise MeshError(f"mesh has {len(free)} axes set to -1 ({', '.join(names[i] for i in free)}); "
                        "set at most one axis to -1")
    for i, s in enumerate(shape):
        if s == 0 or s < -1:
            raise MeshError(f"mesh.{names[i]}={s} is not a positive size; use a positive int or -1")
    if free:
        rest = math.prod(s for s in shape if s != -1)
        if n_devices % rest:
            raise MeshError(f"mesh {named(names, shape)} cannot fill {n_devices} devices: {n_devices} is not "
                            f"divisible by {rest}, the product of the other axes; choose axis sizes whose product "
                            f"divides {n_devices}")
        shape[free[0]] = n_devices // rest
    if math.prod(shape) != n_devices:
        raise MeshError(f"mesh {named(names, shape)} has {math.prod(shape)} devices but "
                        f"{n_devices} are available; make the product {n_devices} or set one axis to -1")
    split = tuple(int((dcn or {}).get(n, 1)) for n in names)
    for a, s, d in zip(axes, shape, split):
        if s % d:
            raise MeshError(f"mesh.{a.dcn_key}={d} does not divide mesh.{a.name}={s}; use a divisor of {s}")
    return MeshShape(names, tuple(shape), split)


def shape_of(keys, n_devices: int) -> MeshShape:
    """The shape a config's mesh section asks for on n devices: a size key per axis of its `axes` (AXES where it
    names none) and a `dcn_NAME` key per axis that may span hosts."""
    axes = getattr(keys, "axes", AXES)
    return resolve({a.name: getattr(keys, a.name) for a in axes}, n_devices,
                   {a.name: getattr(keys, a.dcn_key) for a in axes if a.dcn}, axes)


def devices_named(keys) -> int | None:
    """The devices a config's mesh section names (the product of its sizes); None where an axis is -1."""
    sizes = [getattr(keys, a.name) for a in getattr(keys, "axes", AXES)]
    return math.prod(sizes) if min(sizes) > 0 else None


def recorded(mesh: Mapping[str, int], names: Sequence[str] | None = None) -> MeshShape:
    """The shape a checkpoint's metadata records ({axis: size}) over the axes `names` (default: AXES'); an axis it
    lacks (saved before the axis existed) reads as 1."""
    names = tuple(names or (a.name for a in AXES))
    return MeshShape(names, tuple(int(mesh.get(n, 1)) for n in names), (1,) * len(names))


def shapes(n_devices: int, over: Sequence[str], axes: Sequence[Axis] = AXES) -> Iterator[MeshShape]:
    """Every shape of n devices over the axes `over` (the others 1): the first of them takes the devices the rest
    leave, the last varies slowest, each over its divisors in increasing order."""
    first, *varied = over

    def fill(left: int, todo: list[str]) -> Iterator[dict]:
        if not todo:
            yield {first: left}
            return
        small = [d for d in range(1, math.isqrt(left) + 1) if left % d == 0]  # sqrt(n) trials, whatever n's size
        for d in sorted({x for s in small for x in (s, left // s)}):
            for sizes in fill(left // d, todo[:-1]):
                yield {**sizes, todo[-1]: d}

    for sizes in fill(n_devices, varied):
        yield mesh_shape(sizes, axes)
