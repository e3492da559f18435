"""The KV cache group kinds: one class per kind in each layer that knows
kinds, found through one registry per layer, and no code elsewhere that
compares a kind by its name.

The registries: spec/kv_kinds.py (the spec's rules, the source of the
names), impl/kv_kinds.py, schedspec/check/kv_kinds.py,
schedspec/adapters/vllm_kinds.py and gpu_runner/attention_kinds.py."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from schedspec.adapters import vllm_kinds
from schedspec.check import kv_kinds as check_kinds
from schedspec.impl import kv_kinds as impl_kinds
from schedspec.spec import kv_kinds
from schedspec.spec.interface import KVCacheGroup, SchedulerConfig
from schedspec.spec.rule_names import RULES

ROOT = Path(__file__).resolve().parents[1]
#: The folders holding the project's code (schedspec/'s symlinks to the
#: top-level folders are walked as those folders).
CODE = ("spec", "impl", "invariants", "gpu_runner", "schedspec")
#: The registry modules: the only places that may tell kinds apart by name.
REGISTRIES = frozenset({
    "spec/kv_kinds.py", "impl/kv_kinds.py", "schedspec/check/kv_kinds.py",
    "schedspec/adapters/vllm_kinds.py", "gpu_runner/attention_kinds.py",
})
NAMES = frozenset(kv_kinds.KINDS)


def _example(name: str) -> KVCacheGroup:
    """A valid group of each kind (block size 4)."""
    fields = {f: 8 for f in kv_kinds.KINDS[name].fields}
    return KVCacheGroup(name, **fields)


def test_every_layer_registers_every_kind() -> None:
    assert NAMES == {"full_attention", "sliding_window", "chunked_local", "mamba"}
    assert set(impl_kinds.KINDS) == NAMES
    assert set(check_kinds.KINDS) == NAMES
    assert set(vllm_kinds.KINDS) == NAMES


def test_the_runner_registers_every_kind() -> None:
    pytest.importorskip("torch")
    from schedspec.gpu_runner import attention_kinds

    assert set(attention_kinds.ATTENTION) == NAMES
    for name, k in attention_kinds.ATTENTION.items():
        assert k.name == name
        assert k.kv_group(8 if k.flag else 0).kind == name
        assert k.keeps_state == kv_kinds.KINDS[name].keeps_state
        # a kind that keeps state is local (nulls in its tables) and has no size
        assert bool(k.flag) == (k.local and not k.keeps_state)
        assert k.local == kv_kinds.KINDS[name].skips


def test_each_spec_kind_declares_its_fields_rules_and_words() -> None:
    for name, k in kv_kinds.KINDS.items():
        assert k.name == name and k.label == name.replace("_", "-")
        assert set(k.fields) <= set(kv_kinds.GROUP_FIELDS)
        for rule in (k.capped_rule, k.hit_skipped_rule, k.freed_rule):
            assert rule is None or rule in RULES
        # a kind that skips names the rules of its frees, and says what it reads
        assert (k.freed_rule is not None) == k.skips == (k.describe(_example(name)) != "")
        assert not (k.skips and k.downward_closed)


def test_a_field_of_another_kind_is_refused_by_name() -> None:
    from schedspec.spec.errors import ConfigError

    for name, k in kv_kinds.KINDS.items():
        for field in kv_kinds.GROUP_FIELDS:
            if field in k.fields:
                continue
            group = KVCacheGroup(name, **{**{f: 8 for f in k.fields}, field: 8})
            with pytest.raises(ConfigError) as err:
                SchedulerConfig(block_size=4, num_blocks=64, kv_cache_groups=(KVCacheGroup(), group))
            assert f"kv_cache_groups[1].{field}" in str(err.value)


def test_impl_and_the_spec_agree_on_each_kind() -> None:
    # impl's own classes (written apart) give the spec's skipped tokens and caps
    for name in NAMES:
        group = _example(name)
        spec_kind, impl_rules = kv_kinds.KINDS[name], impl_kinds.rules_of(group)
        for n in range(0, 40):
            assert impl_rules.skipped_tokens(n) == spec_kind.num_skipped_tokens(group, n)
        for in_flight in (0, 3, 16):
            assert impl_rules.cap(4, in_flight, 64) == spec_kind.admission_cap(group, 4, in_flight, 64)
        assert impl_rules.downward_closed == spec_kind.downward_closed


# ---------------------------------------------------------------- no comparison by name


def name_comparisons(source: str, names: frozenset[str] = NAMES) -> list[int]:
    """Lines of ``source`` that compare with a kind name (``x.kind ==
    "sliding_window"``, ``kind in ("sliding_window", ...)``, ``"chunked_local"
    in kinds``) or key a dict literal by one (a per-kind table outside a
    registry), or lists kind names in a tuple, list or set literal (a
    constant to compare with elsewhere)."""

    def is_name(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(is_name(e) for e in node.elts)
        return False

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(is_name(x) for x in (node.left, *node.comparators)):
            found.add(node.lineno)
        elif isinstance(node, ast.Dict) and any(k is not None and is_name(k) for k in node.keys):
            found.add(node.lineno)
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and is_name(node):
            found.add(node.lineno)  # a list of kind names to compare with later
    return sorted(found)


def code_files() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for top in CODE:
        for dirpath, _, filenames in os.walk(ROOT / top):
            for f in filenames:
                if f.endswith(".py"):
                    path = Path(dirpath) / f
                    out[str(path.relative_to(ROOT))] = path
    return out


def test_no_code_outside_the_registries_compares_a_kind_by_name() -> None:
    files = code_files()
    assert REGISTRIES <= set(files)
    bad = {rel: lines for rel, path in files.items() if rel not in REGISTRIES
           for lines in [name_comparisons(path.read_text())] if lines}
    assert not bad, f"kind names compared outside the kind registries: {bad}"


def test_the_scan_finds_the_comparisons_it_is_given() -> None:
    source = (
        'if group.kind == "chunked_local":\n    pass\n'
        'x = g.kind in ("sliding_window", "chunked_local")\n'
        'y = "full_attention" not in kinds\n'
        'NAMES = {"sliding_window": "SlidingWindowManager"}\n'
        'ok = KVCacheGroup("sliding_window", 4)\n'
        'fine = t.kind == "schedule"\n'
        'SKIPPING = ("sliding_window", "chunked_local")\n'
    )
    assert name_comparisons(source) == [1, 3, 4, 5, 8]
