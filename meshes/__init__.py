"""The device mesh (data, stage, model), the logical->mesh rules table and ZeRO shardings."""
from meshes.mesh import AXES, MeshError, build_mesh, resolve_shape, load_preset, preset_names
from meshes.rules import RULES, Layout, logical_to_spec

__all__ = ["AXES", "MeshError", "build_mesh", "resolve_shape", "load_preset", "preset_names",
           "RULES", "Layout", "logical_to_spec"]
