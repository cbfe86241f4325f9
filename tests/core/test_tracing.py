"""BatchLinks: a batched call links to the span of each request it carries, including a request
that ended before its release was sent."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from kvfleet.core.tracing import BatchLinks


def context_of_span(trace_id: int, span_id: int):
    span = NonRecordingSpan(SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(1)))
    return trace.set_span_in_context(span)


def linked(links) -> set[tuple[int, int]]:
    return {(link.context.trace_id, link.context.span_id) for link in links}


def test_a_batch_links_each_request_once_and_skips_sequences_without_a_trace():
    live = {"a": context_of_span(1, 10), "b": context_of_span(2, 20), "a2": context_of_span(1, 10)}
    links = BatchLinks(live.get)
    assert linked(links.take(["a", "b", "a", "a2", "warmup"])) == {(1, 10), (2, 20)}


def test_a_held_release_keeps_its_link_after_the_request_is_gone():
    live = {"a": context_of_span(1, 10)}
    links = BatchLinks(live.get)
    links.hold(["a"])
    del live["a"]  # the request's stream ended before the write-behind release went out
    assert linked(links.take(["a"])) == {(1, 10)}
    assert links.take(["a"]) == []  # given up once sent


def test_held_contexts_are_bounded():
    live = {str(i): context_of_span(1, i + 1) for i in range(10)}
    links = BatchLinks(live.get, max_held=3)
    links.hold(list(live))
    live.clear()
    assert linked(links.take(list(map(str, range(10))))) == {(1, 8), (1, 9), (1, 10)}  # the newest three
