"""Lenient parsing and the summarised log of malformed requests."""

from __future__ import annotations

import logging

from mha_client.api import attention_pb2 as pb
from mha_serve.transport.handlers import Malformed, MalformedLog, lenient


def test_lenient_parse_returns_the_message_or_malformed():
    parse = lenient(pb.GetSessionRequest)
    assert parse(pb.GetSessionRequest(session_id="x").SerializeToString()).session_id == "x"
    bad = parse(b"\x0a\xff")
    assert isinstance(bad, Malformed) and bad.type_name == "mha.v1.GetSessionRequest"
    assert bad.message.startswith("request is not a valid mha.v1.GetSessionRequest message")


def test_malformed_log_summarises_per_interval(caplog):
    now = [0.0]
    summary = MalformedLog(every_s=60, clock=lambda: now[0])
    bad = lenient(pb.AttendRequest)(b"\x0a\xff")
    with caplog.at_level(logging.WARNING, logger="mha_serve.transport.handlers"):
        for _ in range(500):  # a burst: the first is logged, the rest wait for the interval
            summary.note("Attend", "ipv4:127.0.0.1:1", bad)
        now[0] = 30.0
        summary.note("Attend", "ipv4:127.0.0.1:1", bad)
        now[0] = 61.0
        summary.note("Attend", "ipv4:127.0.0.1:2", bad)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("1 malformed request(s)")
    assert lines[1].startswith(
        "501 malformed request(s) answered INVALID_ARGUMENT in the last 60 s"
    )
    assert "ipv4:127.0.0.1:2" in lines[1] and "mha.v1.AttendRequest" in lines[1]
