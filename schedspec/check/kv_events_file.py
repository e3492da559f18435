"""The KV cache events as a product: a stream a router developer can test a
consumer against (``schedspec check --events FILE``), written as JSON lines,
and read back with every line checked.

One line per event: ``{"workload": SEED, "step": N, "event": {...}}`` with
the event as spec/kv_events.py's ``event_to_dict`` writes it (``type`` is
vLLM's class name). Each workload is a fresh instance: a consumer starts
from an empty cache where ``workload`` changes. ``step`` is the plan whose
update took the events (vLLM takes them once per update_from_output)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

from schedspec.spec.kv_events import KVCacheEvent, KVEventError, event_from_dict, event_to_dict


class EventsWriter:
    """Appends the stream to ``path`` (emptied when made), a line per event."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")
        self.count = 0

    def sink(self, workload: int) -> Callable[[int, tuple[KVCacheEvent, ...]], None]:
        """The Runner.kv_event_sink of one workload."""
        def write(step: int, events: tuple[KVCacheEvent, ...]) -> None:
            with self.path.open("a") as f:
                for e in events:
                    f.write(json.dumps({"workload": workload, "step": step, "event": event_to_dict(e)}) + "\n")
            self.count += len(events)
        return write


def read_events(path: Path) -> Iterator[tuple[int, int, KVCacheEvent]]:
    """(workload, step, event) per line of a recorded stream; KVEventError
    naming the file, the line and the field of the first bad one."""
    with path.open() as f:
        for n, line in enumerate(f, 1):
            where = f"{path} line {n}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise KVEventError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(raw, dict):
                raise KVEventError(f"{where}: a line is a JSON object, got {type(raw).__name__}")
            for field in ("workload", "step"):
                if not isinstance(raw.get(field), int):
                    raise KVEventError(f"{where}: {field}: must be an int, got {raw.get(field)!r}")
            try:
                event = event_from_dict(raw.get("event"))
            except KVEventError as exc:
                raise KVEventError(f"{where}: event.{exc}") from None
            yield raw["workload"], raw["step"], event


def stream_problems(path: Path) -> list[str]:
    """What a router could not make sense of in a recorded stream (a file of
    ``read_events``'s form, from ``check --events`` or a live engine's
    events written alike): each workload folded into a fresh router mirror
    (invariants/kv_mirror.py), every parent never stored in a full-attention
    group and every removal of a key no block holds, as ``FILE: workload W
    step N: message``. Malformed lines raise KVEventError."""
    from schedspec.invariants.kv_mirror import KVMirror

    out: list[str] = []
    mirror, current = KVMirror(), None
    for workload, step, event in read_events(path):
        if workload != current:
            mirror, current = KVMirror(), workload
        out.extend(f"{path}: workload {workload} step {step}: {message}" for _, message in mirror.apply(event))
    return out
