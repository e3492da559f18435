"""``schedspec bench --kv-events --stats``: the schedulers built with the
outputs on, a schedspec scheduler's update followed by its take and its
statistics, in the timed step (schedspec/bench/outputs.py)."""

from __future__ import annotations

import contextlib
import io
from typing import Any

from schedspec.bench.outputs import WithOutputs, with_outputs
from schedspec.cli.main import main
from schedspec.spec.interface import SchedulerConfig
from schedspec.spec.scheduler import SpecScheduler


class Counting(SpecScheduler):
    taken = made = 0

    def take_kv_events(self) -> Any:
        Counting.taken += 1
        return super().take_kv_events()

    def make_stats(self) -> Any:
        Counting.made += 1
        return super().make_stats()


def test_the_factories_turn_the_outputs_on_and_each_update_pays_for_them() -> None:
    sched: Any = with_outputs({"s": Counting}, events=True, stats=True)["s"](SchedulerConfig())
    assert isinstance(sched, WithOutputs)
    inner: Any = sched.inner
    assert inner.kv.events is not None and inner.stats_record is not None
    from schedspec.bench.scheduler import fake_result

    plan = sched.schedule()
    sched.update(plan, fake_result(plan))
    assert (Counting.taken, Counting.made) == (1, 1)
    plain = with_outputs({"s": SpecScheduler}, events=False, stats=False)["s"](SchedulerConfig())
    assert type(plain) is SpecScheduler


def test_the_cli_says_the_outputs_are_on() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["bench", "--quick", "--against", "impl", "--modes", "sync", "--kv-events", "--stats"])
    assert rc == 0, out.getvalue()
    assert "outputs: KV cache events taken and statistics made after every update" in out.getvalue()
    assert "decode-" in out.getvalue()
