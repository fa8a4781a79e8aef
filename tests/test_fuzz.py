"""A bounded run of the property-based fuzz (`benchmarks/fuzz.py`) against the session's app: no drawn request gets
a 5xx or a body that is not OpenAI's JSON, and the app answers as before afterwards."""

from __future__ import annotations

from benchmarks.fuzz import answers_correctly, fuzz

MODEL = "tiny-llama"


def test_two_hundred_drawn_requests_get_no_5xx_and_leave_the_app_answering_the_same(tiny_app):
    before = answers_correctly(tiny_app.base_url, tiny_app.headers, MODEL, None)
    report = fuzz(tiny_app.base_url, tiny_app.headers, MODEL, n=200, rng_seed=1)
    summary = report.summary()
    assert report.requests == 200, summary
    assert not report.server_errors and not report.not_json, summary["examples"]
    assert set(report.statuses) & {200} and set(report.statuses) & {400}, summary  # it drew both kinds
    answers_correctly(tiny_app.base_url, tiny_app.headers, MODEL, before)
