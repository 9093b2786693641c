"""The logical->mesh rules (a run's own, read-only: `Rules`; the base table RULES), and the ZeRO stage ->
sharding mapping (`Layout`, which carries its run's rules: every spec and activation constraint comes from them).

Model code names logical axes only; this file is the one place that maps them to the
mesh axes (meshes/axes.py). Megatron's split: attention heads and MLP hidden units
are column-split over `model` on the way in and row-split on the way out; the vocabulary
is split over `model` too.

ZeRO (DESIGN.md):
  stage 0: params, grads, optimizer state replicated over `data`
  stage 1: optimizer state sharded over `data`
  stage 2: + gradients reduce-scattered and kept sharded over `data`
  stage 3: + parameters sharded over `data`, all-gathered per layer
A leaf whose logical axes the rules already map to a batch axis (e.g. experts="expert": each expert rank holds its own
experts) is split by its rule at every stage; ZeRO shards it over the batch axes left (`data`, `context`), on
another dimension.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshes.axes import CONTEXT, DATA, MODEL, STAGE


class Rules(Mapping):
    """A run's logical -> mesh table, read-only: each logical axis to a mesh axis, a tuple of them, or None
    (replicated). A run's differs from RULES by entries its config adds (`replace`)."""

    def __init__(self, table: Mapping[str, str | tuple | None]):
        self._table = dict(table)

    def __getitem__(self, name: str):
        return self._table[name]

    def __iter__(self):
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __hash__(self) -> int:
        return hash(tuple(self._table.items()))

    def __repr__(self) -> str:
        return f"Rules({self._table})"

    def replace(self, **entries) -> "Rules":
        """These rules with some logical axes mapped anew (e.g. experts="data")."""
        return Rules({**self._table, **entries})

    def sequence(self, context: int, split_residual: bool) -> "Rules":
        """These rules with each sequence's tokens over `context` where it has more than one rank, and with
        `split_residual` (train.sequence_parallel) the residual stream's over `model` too; these rules themselves
        where they say so already."""
        seq = CONTEXT if context > 1 else None
        entries = {"seq": seq, "res_seq": ((CONTEXT, MODEL) if context > 1 else MODEL) if split_residual else seq}
        return self if all(self._table[k] == v for k, v in entries.items()) else self.replace(**entries)

    def without(self, axes) -> "Rules":
        """These rules with some mesh axes dropped (for code running manual over them)."""
        return Rules({k: _drop(v, set(axes)) for k, v in self._table.items()})

    def spec(self, logical: tuple[str | None, ...], shape=None, mesh=None) -> P:
        """PartitionSpec for logical axis names (with `shape` and `mesh`: SHARED_WHEN_SMALLER applied)."""
        out = []
        for i, name in enumerate(logical):
            if name is not None and name not in self._table:
                raise KeyError(f"logical axis '{name}' has no rule in this run's rules (meshes/rules.py)")
            entry = None if name is None else self._table[name]
            if entry is not None and shape is not None and name in SHARED_WHEN_SMALLER \
                    and shape[i] < _axis_size(mesh, entry):
                entry = None
            out.append(entry)
        return P(*out)


def keep(spec: P, axes) -> P:
    """The spec with mesh axes outside `axes` dropped (the spec over the axes a shard_map makes manual)."""
    def entry(e):
        names = tuple(n for n in (e if isinstance(e, tuple) else (e,)) if n in axes)
        return names[0] if len(names) == 1 else (names or None)
    return P(*(entry(e) for e in spec))


def mesh_axes(spec: P) -> set[str]:
    """Every mesh axis a spec splits some dimension over."""
    return {n for e in spec if e is not None for n in (e if isinstance(e, tuple) else (e,))}


def _drop(entry, axes: set[str]):
    if isinstance(entry, tuple):
        kept = tuple(a for a in entry if a not in axes)
        return kept[0] if len(kept) == 1 else (kept or None)
    return None if entry in axes else entry


# The base table: logical axis -> mesh axis (None = replicated). Activations and parameters share it;
# parameters add the ZeRO/FSDP rule (`data` on one more dimension) on top.
RULES = Rules({
    "batch": DATA,
    "seq": None,
    # the residual stream's sequence (each layer's input and output, the norms before the column-parallel
    # matmuls): as `seq`, and over `model` too with train.sequence_parallel (Rules.sequence)
    "res_seq": None,
    "embed": None,
    "heads": MODEL,
    "kv_heads": MODEL,
    "head_dim": None,
    "mlp": MODEL,
    "vocab": MODEL,
    "layers": STAGE,
    "first_layers": None,  # a family's first layers of another kind (DeepSeek's dense ones): on the first stage
    "mtp": None,  # the multi-token prediction modules (model.mtp_depth): with the head
    "experts": None,  # an MoE layer's experts: whole on every device (split over `data` by a run's rules)
})
# Logical axes that may be smaller than their mesh axis: where the size divides the mesh axis's, the
# dimension is replicated over it (fewer kv heads than `model`: every model rank keeps the kv heads and
# uses the one its query heads share, as Megatron-LM and MaxText do).
SHARED_WHEN_SMALLER = ("kv_heads",)
# The dimension ZeRO shards over `data`, in order of preference (FSDP shards `embed`).
# `layers` is never chosen: the layer scan slices it, and `stage` may already split it.
ZERO_PREFERENCE = ("embed", "mlp", "vocab", "head_dim", "heads", "kv_heads")


def _axis_size(mesh: Mesh, entry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def _add_data(spec: P, dim: int | None, ndim: int, zero=(DATA,)) -> P:
    """The spec with ZeRO's mesh axes `zero` (outermost first) added to dimension `dim`."""
    entries = list(spec) + [None] * (ndim - len(spec))
    if dim is not None:
        e = entries[dim]
        new = tuple(zero) + (() if e is None else e if isinstance(e, tuple) else (e,))
        entries[dim] = new[0] if len(new) == 1 else new
    return P(*entries)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Shardings of every piece of training state for one mesh, ZeRO stage and set of rules (a run's own)."""
    mesh: Mesh
    zero_stage: int = 0
    rules: Rules = RULES

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def compute_spec(self, shape, logical) -> P:
        """Spec a weight has when it is used (no ZeRO split)."""
        return _add_data(self.rules.spec(logical, shape, self.mesh), None, len(shape))

    def sharded_spec(self, shape, logical) -> P:
        """Spec with the ZeRO split (over the leaf's `leaf_zero_axes`) added."""
        return _add_data(self.rules.spec(logical, shape, self.mesh), self.data_dim(shape, logical), len(shape),
                         self.leaf_zero_axes(shape, logical))

    def param_spec(self, shape, logical) -> P:
        return self.sharded_spec(shape, logical) if self.zero_stage >= 3 else self.compute_spec(shape, logical)

    def grad_spec(self, shape, logical) -> P:
        return self.sharded_spec(shape, logical) if self.zero_stage >= 2 else self.compute_spec(shape, logical)

    def opt_spec(self, shape, logical) -> P:
        return self.sharded_spec(shape, logical) if self.zero_stage >= 1 else self.compute_spec(shape, logical)

    def leaf_zero_axes(self, shape, logical) -> tuple[str, ...]:
        """The mesh axes ZeRO shards a leaf over: `zero_axes` but those its rules split it over already (an MoE's
        experts split over `expert`: ZeRO shards them over `data` alone, as MaxText's FSDP x expert)."""
        split = self.rule_axes(shape, logical)
        return tuple(a for a in self.zero_axes if a not in split)

    def data_dim(self, shape, logical) -> int | None:
        """The dimension ZeRO shards over the leaf's `leaf_zero_axes` (None: the leaf stays replicated over them,
        e.g. too small, or there are none left); for manual collectives in shard_map too."""
        k = math.prod(self.mesh.shape[a] for a in self.leaf_zero_axes(shape, logical))
        base = self.rules.spec(logical, shape, self.mesh)
        if k == 1:
            return None
        order = sorted((i for i in range(len(shape)) if logical[i] in ZERO_PREFERENCE),
                       key=lambda i: (ZERO_PREFERENCE.index(logical[i]), -shape[i]))
        for i in order:
            if shape[i] % (k * _axis_size(self.mesh, base[i])) == 0:
                return i
        return None

    def split(self, logical: str) -> int:
        """Devices a logical axis is split over by the rules (1: replicated)."""
        return _axis_size(self.mesh, self.rules[logical])

    def rule_axes(self, shape, logical) -> set[str]:
        """The mesh axes the rules themselves split a leaf over (ZeRO aside)."""
        return mesh_axes(self.rules.spec(logical, shape, self.mesh))

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over: each holds other rows, so gradients are summed over them."""
        return tuple(sorted(mesh_axes(self.batch_spec()), key=self.mesh.axis_names.index))

    def manual_spec(self, kind: str, shape, logical, manual) -> P:
        """A leaf's `kind` spec (param | grad | opt | compute) over the mesh axes a shard_map makes manual: what
        each rank's block of it is there (a leaf the rules split over `data` stays split at every ZeRO stage)."""
        return keep(getattr(self, f"{kind}_spec")(shape, logical), set(manual))

    @property
    def zero_axes(self) -> tuple[str, ...]:
        """The mesh axes ZeRO shards state over: the batch's (gradients are summed over them): `data`, `expert`
        where the rules split rows over it too, and `context` where they split sequences over it (a context rank is
        data-parallel for the weights)."""
        return tuple(a for a in self.mesh.axis_names if a in mesh_axes(self.batch_spec()) or a == DATA)

    def batch_spec(self) -> P:
        """A (B, T) batch field's spec: rows over `data`, and each row's tokens over `context` where the rules
        split sequences (context parallelism)."""
        rows, seq = self.rules.spec(("batch", "seq"))
        return P(rows) if seq is None else P(rows, seq)

    def tree(self, kind: str, shapes, logical):
        """NamedShardings for a pytree of ShapeDtypeStructs and the matching logical-axes tree."""
        fn = getattr(self, f"{kind}_spec")
        return jax.tree.map(lambda s, lg: self.sharding(fn(s.shape, lg)), shapes, logical)

    def constrainer(self, manual: frozenset[str] = frozenset()):
        """constrain(x, logical_axes): a sharding constraint on an activation through the rules, traced under
        `jax.set_mesh(mesh)`; inside a shard_map manual over some mesh axes, name them (`manual`): the rules
        drop them there."""
        if self.mesh.size == 1:
            return lambda x, logical: x
        rules, mesh = self.rules.without(manual), self.mesh

        def constrain(x, logical):
            return jax.lax.with_sharding_constraint(x, rules.spec(logical, x.shape, mesh))
        return constrain
