"""Which jax platforms a process starts: no TPU runtime on a machine without TPU chips.

With libtpu installed (the `tpu` extra, which `meshtrain plan --compile-for` needs to compile for TPU
topologies ahead of time), jax starts a TPU runtime at its first device query even where no chip is
present: libtpu looks for a TPU metadata server, prints warnings to stderr and takes about a second.
`avoid_absent_tpu`, run when the package is imported, then leaves the TPU platform out: it sets
`jax_platforms` (and JAX_PLATFORMS, for the processes this one starts) to the other installed platforms.
It does nothing where JAX_PLATFORMS is set, libtpu is absent, a TPU chip is on the PCI bus, or jax has
already started its backends. A topology for an ahead-of-time compile still loads libtpu when asked.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pkgutil

_GOOGLE_PCI = "0x1ae0"


def tpu_chips() -> int:
    """TPU chips on this machine's PCI bus (jax's own count where it has one)."""
    try:
        from jax._src import hardware_utils
        return hardware_utils.num_available_tpu_chips_and_device_id()[0]
    except (ImportError, AttributeError):  # a jax without it: any Google PCI device counts as a chip
        import glob
        return sum(open(p).read().strip() == _GOOGLE_PCI for p in glob.glob("/sys/bus/pci/devices/*/vendor"))


def _other_platforms() -> list[str]:
    """The installed jax platforms other than TPU: GPU plugins (jax_plugins.xla_cuda12, ...) and cpu."""
    names = {ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")}
    try:
        import jax_plugins
        names |= {m.name for m in pkgutil.iter_modules(jax_plugins.__path__)}
    except ImportError:
        pass
    found = [p for p in ("cuda", "rocm") if any(p in n for n in names)]
    return found + ["cpu"]


def avoid_absent_tpu() -> str | None:
    """Leave TPU out of the platforms jax starts when libtpu is installed but no chip is present;
    returns the platforms set, or None where nothing changed."""
    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return None
    import jax
    from jax._src import xla_bridge
    started = getattr(xla_bridge, "backends_are_initialized", lambda: False)()
    if jax.config.jax_platforms or started or tpu_chips():
        return None
    platforms = ",".join(_other_platforms())
    os.environ["JAX_PLATFORMS"] = platforms
    jax.config.update("jax_platforms", platforms)
    return platforms
