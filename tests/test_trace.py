"""ddlab.runtime.trace: spans, exclusive totals, and the Chrome trace format Perfetto opens."""

from __future__ import annotations

import json
import time

import pytest
from ddlab.runtime.trace import Span, Tracer, breakdown, chrome_trace, gather_spans, totals, write_chrome_trace
from mpi4py import MPI


def test_spans_record_their_duration():
    tracer = Tracer(rank=2)
    with tracer.span("work"):
        time.sleep(0.01)
    (span,) = tracer.spans
    assert span.name == "work" and span.rank == 2 and span.track == "main"
    assert 0.009 <= span.duration < 1.0


def test_a_disabled_tracer_records_nothing():
    tracer = Tracer(enabled=False)
    with tracer.span("work"):
        pass
    tracer.add("other", 0.0, 1.0)
    assert tracer.spans == []


def test_exclusive_totals_subtract_nested_spans():
    spans = [
        Span("backward", 0.0, 10.0),
        Span("allreduce", 2.0, 3.0),
        Span("allreduce", 8.0, 10.0),
        Span("optimizer", 10.0, 11.0),
        Span("bucket 0", 2.0, 9.0, track="in flight"),
    ]
    assert totals(spans) == {"backward": 7.0, "allreduce": 3.0, "optimizer": 1.0}
    assert totals(spans, exclusive=False) == {"backward": 10.0, "allreduce": 3.0, "optimizer": 1.0}
    assert totals(spans, track="in flight") == {"bucket 0": 7.0}
    assert totals(spans, track=None)["bucket 0"] == 7.0


def test_deeper_nesting_counts_each_second_once():
    spans = [Span("a", 0, 10), Span("b", 1, 9), Span("c", 2, 3), Span("c", 4, 5), Span("d", 10, 12)]
    assert totals(spans) == {"a": 2, "b": 6, "c": 2, "d": 2}
    assert sum(totals(spans).values()) == 12


def test_breakdown_fills_missing_phases_with_zero():
    per_rank = [[Span("forward", 0, 1)], [Span("forward", 0, 2), Span("data", 2, 3)]]
    assert breakdown(per_rank, ["data", "forward"]) == [{"data": 0.0, "forward": 1.0}, {"data": 1.0, "forward": 2.0}]


def test_chrome_trace_has_a_process_per_rank_and_a_thread_per_track(tmp_path):
    per_rank = [
        [Span("forward", 0.001, 0.002, rank=0), Span("bucket 0", 0.0015, 0.003, "in flight", 0)],
        [Span("forward", 0.001, 0.0025, rank=1)],
    ]
    trace = chrome_trace(per_rank)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["tid"], e["name"]) for e in complete] == [
        (0, 0, "forward"),
        (0, 1, "bucket 0"),
        (1, 0, "forward"),
    ]
    assert complete[0]["ts"] == pytest.approx(1000.0) and complete[0]["dur"] == pytest.approx(1000.0)
    names = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["name"] in ("process_name", "thread_name")
    }
    assert names[(0, None)] == "rank 0" and names[(0, 1)] == "in flight"
    path = write_chrome_trace(tmp_path / "sub" / "run.trace.json", per_rank)
    assert json.loads(path.read_text()) == trace


def test_align_and_gather_on_one_process():
    tracer = Tracer()
    with tracer.span("before"):
        pass
    tracer.align(MPI.COMM_SELF)
    assert tracer.spans == [] and tracer.now() < 1.0
    with tracer.span("after"):
        pass
    assert [s.name for s in gather_spans(tracer, MPI.COMM_SELF)[0]] == ["after"]
    assert gather_spans(tracer, MPI.COMM_SELF, root=0)[0][0].name == "after"
