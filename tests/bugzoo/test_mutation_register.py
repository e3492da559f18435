"""The register of equivalent mutants names functions that exist.

tools/mutation/equivalent_mutants.py lists, by mutmut 3 name, the mutants of
spec/ and impl/ examined by hand and found equivalent. A name whose function was
renamed or removed, or that is not spelled as mutmut spells it for the paths
tools/mutation/run_mutmut.sh mutates, would silently stop matching anything;
this test keeps the register in step with the source (the mutant numbers
themselves are checked by tools/mutation/mutation_report.py after a mutation
run).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tools.mutation.equivalent_mutants import EQUIVALENT, REASONS


def _resolve(name: str) -> object:
    function = name.rsplit("__mutmut_", 1)[0]
    module_name, _, rest = function.partition(".x")
    # mutmut 3 names: module.x_function or module.xǁClassǁmethod
    module = importlib.import_module(module_name)
    if rest.startswith("ǁ"):
        _, cls, method = rest.split("ǁ")
        return getattr(getattr(module, cls), method)
    assert rest.startswith("_"), name
    return getattr(module, rest[1:])


@pytest.mark.parametrize("name", sorted({n.rsplit("__mutmut_", 1)[0] for n in EQUIVALENT}))
def test_register_names_an_existing_function(name: str) -> None:
    # mutmut names a mutant by the path it mutated: schedspec/spec/rules.py
    # gives schedspec.spec.rules.x_..., the module the tests import
    assert name.startswith(("schedspec.spec.", "schedspec.impl.")), name
    assert callable(_resolve(name + "__mutmut_1")), name


def test_every_entry_has_a_documented_reason() -> None:
    assert EQUIVALENT, "the register is empty"
    assert set(EQUIVALENT.values()) <= set(REASONS)
    for reason, text in REASONS.items():
        assert len(text) > 40, reason
