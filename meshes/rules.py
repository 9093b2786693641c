"""The single logical->mesh rules table, and the ZeRO stage -> sharding mapping.

Model code names logical axes only; this file is the one place that maps them to the
mesh axes (data, stage, model). Megatron's split: attention heads and MLP hidden units
are column-split over `model` on the way in and row-split on the way out; the vocabulary
is split over `model` too.

ZeRO (DESIGN.md):
  stage 0: params, grads, optimizer state replicated over `data`
  stage 1: optimizer state sharded over `data`
  stage 2: + gradients reduce-scattered and kept sharded over `data`
  stage 3: + parameters sharded over `data`, all-gathered per layer
"""
from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# logical axis -> mesh axis (None = replicated). Activations and parameters share it;
# parameters add the ZeRO/FSDP rule (`data` on one more dimension) on top.
RULES: dict[str, str | None] = {
    "batch": "data",
    "seq": None,
    "embed": None,
    "heads": "model",
    "kv_heads": "model",
    "head_dim": None,
    "mlp": "model",
    "vocab": "model",
    "layers": "stage",
}
# Logical axes that may be smaller than their mesh axis: where the size divides the mesh axis's, the
# dimension is replicated over it (fewer kv heads than `model`: every model rank keeps the kv heads and
# uses the one its query heads share, as Megatron-LM and MaxText do).
SHARED_WHEN_SMALLER = ("kv_heads",)
# The dimension ZeRO shards over `data`, in order of preference (FSDP shards `embed`).
# `layers` is never chosen: the layer scan slices it, and `stage` may already split it.
ZERO_PREFERENCE = ("embed", "mlp", "vocab", "head_dim", "heads", "kv_heads")


def logical_to_spec(logical: tuple[str | None, ...], rules: dict = RULES, shape=None, mesh=None) -> P:
    """PartitionSpec for logical axis names (with `shape` and `mesh`: SHARED_WHEN_SMALLER applied)."""
    out = []
    for i, name in enumerate(logical):
        if name is not None and name not in rules:
            raise KeyError(f"logical axis '{name}' has no rule in meshes.rules.RULES")
        entry = None if name is None else rules[name]
        if entry is not None and shape is not None and name in SHARED_WHEN_SMALLER \
                and shape[i] < _axis_size(mesh, entry):
            entry = None
        out.append(entry)
    return P(*out)


def _axis_size(mesh: Mesh, entry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def zero_dim(shape: tuple[int, ...], logical: tuple[str | None, ...], mesh: Mesh) -> int | None:
    """Which dimension ZeRO shards over `data` (None: the leaf stays replicated, e.g. too small)."""
    k = mesh.shape["data"]
    if k == 1:
        return None
    base = logical_to_spec(logical, RULES, shape, mesh)
    order = sorted((i for i in range(len(shape)) if logical[i] in ZERO_PREFERENCE),
                   key=lambda i: (ZERO_PREFERENCE.index(logical[i]), -shape[i]))
    for i in order:
        if shape[i] % (k * _axis_size(mesh, base[i])) == 0:
            return i
    return None


def _add_data(spec: P, dim: int | None, ndim: int) -> P:
    entries = list(spec) + [None] * (ndim - len(spec))
    if dim is not None:
        e = entries[dim]
        entries[dim] = "data" if e is None else (("data",) + (e if isinstance(e, tuple) else (e,)))
    return P(*entries)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Shardings of every piece of training state for one mesh and ZeRO stage."""
    mesh: Mesh
    zero_stage: int = 0

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def compute_spec(self, shape, logical) -> P:
        """Spec a weight has when it is used (no ZeRO split)."""
        return _add_data(logical_to_spec(logical, RULES, shape, self.mesh), None, len(shape))

    def sharded_spec(self, shape, logical) -> P:
        """Spec with the ZeRO `data` split added."""
        return _add_data(logical_to_spec(logical, RULES, shape, self.mesh), zero_dim(shape, logical, self.mesh),
                         len(shape))

    def param_spec(self, shape, logical) -> P:
        return self.sharded_spec(shape, logical) if self.zero_stage >= 3 else self.compute_spec(shape, logical)

    def grad_spec(self, shape, logical) -> P:
        return self.sharded_spec(shape, logical) if self.zero_stage >= 2 else self.compute_spec(shape, logical)

    def opt_spec(self, shape, logical) -> P:
        return self.sharded_spec(shape, logical) if self.zero_stage >= 1 else self.compute_spec(shape, logical)

    def data_dim(self, shape, logical) -> int | None:
        """Dimension split over `data` by ZeRO (for manual collectives in shard_map)."""
        return zero_dim(shape, logical, self.mesh)

    def batch_spec(self) -> P:
        return P("data")

    def tree(self, kind: str, shapes, logical):
        """NamedShardings for a pytree of ShapeDtypeStructs and the matching logical-axes tree."""
        fn = getattr(self, f"{kind}_spec")
        return jax.tree.map(lambda s, lg: self.sharding(fn(s.shape, lg)), shapes, logical)


def constrainer(mesh: Mesh | None, rules: dict = RULES):
    """Return constrain(x, logical_axes): a sharding constraint on an activation through RULES.

    Traced under `jax.set_mesh(mesh)`. Inside a shard_map that is manual over some axes,
    pass rules with those axes removed (`without_axes`).
    """
    if mesh is None or mesh.size == 1:
        return lambda x, logical: x

    def constrain(x, logical):
        return jax.lax.with_sharding_constraint(x, logical_to_spec(logical, rules, x.shape, mesh))
    return constrain


def without_axes(rules: dict, axes: set[str]) -> dict:
    """The rules with some mesh axes dropped (for code running manual over them)."""
    return {k: (None if v in axes else v) for k, v in rules.items()}
