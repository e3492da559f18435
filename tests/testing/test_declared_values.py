"""A field's declaration (its type and bounds, spec/validate.py) is the one that
validation, the trace schema and the strategies read: every value
``declared_values`` draws for a field is refused, if at all, by a rule between
fields and never by the field's own checks, and the values just outside its
bounds are refused naming the field."""

from __future__ import annotations

from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedspec.spec import ConfigError, RequestError, RequestSpec, SchedulerConfig
from schedspec.spec.validate import declared
from schedspec.testing.strategies import declared_values

from tests.helpers import cfg

BUILD: dict[type, Callable[..., object]] = {
    SchedulerConfig: cfg,
    RequestSpec: lambda **kw: RequestSpec(**{"request_id": "r", "prompt_token_ids": (1, 2, 3, 4), "max_tokens": 4,
                                             **kw}),
}
FIELDS = [(cls, name) for cls in BUILD for name, _, _ in declared(cls)]


def _own_check_refused(cls: type, name: str, value: object) -> str | None:
    """The message of ``name``'s own type or bounds check refusing ``value``
    (None: accepted, or refused by a rule between fields)."""
    try:
        BUILD[cls](**{name: value})
    except (ConfigError, RequestError) as e:
        text = str(e).split(": ", 2)[-1]
        if e.field == name and (text.startswith("must be") or "beyond the supported maximum" in text):
            return text
    return None


@pytest.mark.parametrize(("cls", "name"), FIELDS, ids=[f"{c.__name__}.{n}" for c, n in FIELDS])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_a_declared_value_passes_its_fields_own_checks(cls: type, name: str, data: Any) -> None:
    value = data.draw(declared_values(cls, name), label=name)
    assert _own_check_refused(cls, name, value) is None


def _outside(kind: Any, d: Any) -> list[object]:
    out: list[object] = []
    if kind in (int, float, int | None) and d.minimum is not None:
        out.append(d.minimum - 1)
    if kind in (int, int | None) and d.maximum is not None:
        out.append(d.maximum + 1)
    if kind is float and d.below is not None:
        out.append(d.below)
    if d.choices:
        out.append("not " + d.choices[0])
    return out


@pytest.mark.parametrize(("cls", "name"), FIELDS, ids=[f"{c.__name__}.{n}" for c, n in FIELDS])
def test_a_value_outside_the_declared_bounds_is_refused_naming_the_field(cls: type, name: str) -> None:
    kind, d = next((k, d) for n, k, d in declared(cls) if n == name)
    for value in _outside(kind, d):
        with pytest.raises((ConfigError, RequestError)) as info:
            BUILD[cls](**{name: value})
        assert info.value.field == name, (value, str(info.value))


def test_every_declared_bound_is_exercised() -> None:
    bounded = [(c, n) for c, n in FIELDS
               if _outside(*next((k, d) for m, k, d in declared(c) if m == n))]
    assert len(bounded) >= 17  # 13 of the config, 4 of the request
