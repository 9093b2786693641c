"""The device mesh: its axes and shape (meshes/axes.py), the one factory (meshes/mesh.py), the logical->mesh rules
and ZeRO shardings (meshes/rules.py), the collectives over logical axes model code gets (meshes/collectives.py)."""
from meshes.axes import (AXES, CONTEXT, DATA, EXPERT, MODEL, STAGE, Axis, MeshError, MeshShape, devices_named, mesh_shape,
                         recorded, resolve, shape_of, shapes)
from meshes.collectives import Collectives
from meshes.mesh import build, build_mesh, load_preset, preset_names
from meshes.rules import RULES, Layout, Rules

__all__ = ["AXES", "DATA", "STAGE", "EXPERT", "CONTEXT", "MODEL", "Axis", "MeshError", "MeshShape", "devices_named", "mesh_shape",
           "recorded", "resolve", "shape_of", "shapes", "Collectives", "build", "build_mesh", "load_preset",
           "preset_names", "RULES", "Layout", "Rules"]
