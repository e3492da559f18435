"""The bug zoo's mutants declaring everything impl declares (every mode, admission
gate and KV feature: schedspec.adapters.registry.impl_capabilities), so the gate
draws the workloads it draws for impl itself. tests/bugzoo/zoo.py's classes declare
nothing beyond the core, and the gate tries them on core workloads only; a bug of a
full-featured scheduler is met among gates, layouts and modes, and the time to
catch it there is what tools/gate_strength.py measures with ``--zoo-as impl``.

    PYTHONPATH=. schedspec check --against tests.bugzoo.zoo_full:WrongFcfsVictim --time 60
"""

from __future__ import annotations

from schedspec.adapters.registry import impl_capabilities
from tests.bugzoo import zoo

CAPABILITIES = impl_capabilities()

ALL = [type(cls.__name__, (cls,), {"CAPABILITIES": CAPABILITIES, "__module__": __name__, "__doc__": cls.__doc__})
       for cls in zoo.ALL]
globals().update({cls.__name__: cls for cls in ALL})
