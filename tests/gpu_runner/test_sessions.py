"""gpu_runner: streaming-input sessions in the equivalence matrix (gpu_runner/sessions.py).

A session's continuation must give what the whole input sent at once gives.
CPU only; a small random model.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from schedspec.check.workload import AddRequest, SessionInput  # noqa: E402
from schedspec.gpu_runner import sessions as S  # noqa: E402
from schedspec.gpu_runner.equivalence import baseline_config, spec_factory  # noqa: E402
from schedspec.gpu_runner.loaders import random_llama  # noqa: E402
from schedspec.gpu_runner.model import LlamaWeights, PagedLlama  # noqa: E402

pytestmark = pytest.mark.torch
torch.set_num_threads(1)

MML = 64


@pytest.fixture(scope="module")
def small() -> LlamaWeights:
    return random_llama(5, vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=128, tie_embeddings=False, max_position=256)


def _workloads(small: LlamaWeights, n: int = 2) -> list[S.SessionWorkload]:
    return S.make_session_workloads(n, vocab_size=small.config.vocab_size, max_model_len=MML)


def test_session_workloads_are_seeded_and_within_the_session_bound(small: LlamaWeights) -> None:
    a, b = _workloads(small, 3), _workloads(small, 3)
    assert [w.workload.events for w in a] == [w.workload.events for w in b]
    for sw in a:
        sessions = {e.request.request_id: e.request for e in sw.workload.events
                    if isinstance(e, AddRequest) and e.request.resumable}
        assert len(sessions) == S.SESSIONS and set(sessions) == set(sw.chunks)
        for sid, r in sessions.items():
            bound = len(r.prompt_token_ids) + r.max_tokens + sum(len(c) + m for c, m in sw.chunks[sid])
            assert bound < MML and sw.chunks[sid]
        updates = [e.update for e in sw.workload.events if isinstance(e, SessionInput)]
        for sid in sessions:  # every chunk in order, then the end
            mine = [u for u in updates if u.request_id == sid]
            assert [(u.prompt_token_ids, u.max_tokens) for u in mine[:-1]] == list(sw.chunks[sid])
            assert mine[-1].end


def test_baseline_prompts_are_the_whole_input_sent_at_once(small: LlamaWeights) -> None:
    """P(j+1) = P(j) + the outputs of chunk j but the last (the dropped one) + chunk j+1."""
    sw = _workloads(small, 1)[0]
    model = PagedLlama(small, mode="exact", window=MML)
    base = S.run_baseline(spec_factory, model, sw, baseline_config(MML))
    for sid, prompts in base.prompts.items():
        assert len(prompts) == 1 + len(sw.chunks[sid])
        for j, (chunk, m) in enumerate(sw.chunks[sid]):
            out = base.record.outputs[f"{sid}#{j}"]
            assert prompts[j + 1] == prompts[j] + out[:-1] + chunk
            assert len(base.record.outputs[f"{sid}#{j + 1}"]) == m


@pytest.mark.parametrize("scheduler", ["spec", "impl"])
def test_session_continuations_equal_the_whole_input_bitwise(small: LlamaWeights, scheduler: str) -> None:
    from schedspec.impl.scheduler import ImplScheduler

    factory = spec_factory if scheduler == "spec" else ImplScheduler
    model = PagedLlama(small, mode="exact", window=MML)
    variants = S.session_variants(MML)
    report = S.run_session_matrix(factory, model, _workloads(small), variants, baseline=baseline_config(MML),
                                  negative=scheduler == "spec")
    assert report.ok, report.table()
    assert [v.name for v in variants] == ["stream", "stream-chunked", "stream-prefix", "stream-tiny",
                                          "stream-async", "stream-all"]
    for c in report.comparisons:
        # every chunk of every session compared, the dropped tokens included, every logits row bitwise
        assert c.tokens_compared > 0 and c.logits_compared == c.logits_bitwise == c.tokens_compared
        assert c.inflight["continued"] > 0, c.variant
    if scheduler == "spec":
        assert {n.fault for n in report.negative} == set(S.SESSION_CONTROLS)
        assert all(n.caught and n.fired for n in report.negative), report.table()


def test_the_continued_guard_fails_when_no_session_is_continued_in_place(
        small: LlamaWeights, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard reads the executor's count: with no dropped positions to
    resume at, nothing counts as continued, and the guard fails."""
    monkeypatch.setattr(S, "_drops", lambda base: {})
    model = PagedLlama(small, mode="exact", window=MML)
    v = S.session_variants(MML)[0]
    report = S.run_session_matrix(spec_factory, model, _workloads(small, 1), [v], baseline=baseline_config(MML),
                                  negative=False)
    assert not report.divergent
    assert report.guard_failures == ["variant stream never continued in 1 workloads"]
    assert not report.ok


def test_the_controls_see_a_kept_dropped_token_and_a_shifted_continuation(small: LlamaWeights) -> None:
    model = PagedLlama(small, mode="exact", window=MML)
    sw = _workloads(small, 1)[0]
    base = S.run_baseline(spec_factory, model, sw, baseline_config(MML))
    for v in (S.session_variants(MML)[0], S.session_variants(MML)[4]):  # sync and async
        for kind in S.SESSION_CONTROLS:
            nc = S.session_control(kind, spec_factory, model, sw, v, base)
            assert nc.caught, (v.name, kind, nc)
    with pytest.raises(ValueError, match="session control"):
        S.session_control("bogus", spec_factory, model, sw, S.session_variants(MML)[0], base)


def test_a_scheduler_without_sessions_or_a_hybrid_model_is_refused(small: LlamaWeights) -> None:
    from schedspec.spec.interface import Scheduler, SchedulerConfig

    class NoSessions:
        def __init__(self, config: SchedulerConfig) -> None:
            self.inner = spec_factory(config)

        def __getattr__(self, name: str) -> object:
            if name == "session_update":
                raise AttributeError(name)
            return getattr(self.inner, name)

    def factory(config: SchedulerConfig) -> Scheduler:
        return NoSessions(config)  # type: ignore[return-value]

    with pytest.raises(ValueError, match="session_update"):
        S.session_extension(factory, workloads=1)
    with pytest.raises(ValueError, match="--sessions needs a model"):
        S.session_extension(spec_factory, workloads=1, hybrid=True)


def test_cli_sessions_adds_the_session_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from schedspec.cli.main import main as schedspec_main

    common = ["equivalence", "--model", "random:seed=1,vocab=256,hidden=64,layers=1", "--workloads", "1",
              "--device", "cpu", "--max-model-len", "64", "--quiet", "--no-connector"]
    rc = schedspec_main([*common, "--sessions", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    for name in ("stream-tiny", "stream-all", "negative control dropped_kv", "negative control stream_position"):
        assert name in out
    assert "DIVERGED s" not in out and "GUARD variant stream" not in out, out
    assert rc in (0, 1)  # one plain workload may leave a guard of the other variants unmet
    assert schedspec_main([*common, "--sessions", "--sliding-window", "24"]) == 2


def test_run_equivalence_sessions_merges_into_one_report(small: LlamaWeights) -> None:
    from schedspec.gpu_runner.equivalence import MatrixReport

    model = PagedLlama(small, mode="exact", window=MML)
    main = MatrixReport("m", "cpu", "exact", ["w0"], [])
    out = S.session_extension(None, workloads=1, negative=False)(main, model, MML)
    assert out is main and main.workloads == ["w0", "s0"]
    assert [v.name for v in main.variants][0] == "stream" and main.ok, main.table()
    assert replace(main, comparisons=[]).ok
