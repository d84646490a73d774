"""Tier 3: the Chrome-trace timeline of a real multi-rank job has each op's phases, in order."""

from __future__ import annotations

import json

import pytest

from conftest import WORKERS, launch


def _phases(events: list[dict], op: str) -> list[dict]:
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    pid = next(p for p, name in rows.items() if name == op)
    return sorted((e for e in events if e.get("pid") == pid and e.get("ph") == "X"), key=lambda e: e["ts"])


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_", [2, 3])
def test_timeline_shows_queue_negotiation_copies_and_ring_phases_in_order(tmp_path, np_: int) -> None:
    path = tmp_path / "timeline.json"
    proc = launch(np_, [str(WORKERS / "timeline_worker.py")], timeout=80, RINGCOMM_TIMELINE=str(path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = json.loads(path.read_text())  # a complete JSON array: the file was closed at shutdown

    expected = {
        "big": ["QUEUE", "NEGOTIATE_ALLREDUCE", "RING_REDUCE_SCATTER", "RING_ALLGATHER"],
        "fused": ["QUEUE", "NEGOTIATE_ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "RING_REDUCE_SCATTER", "RING_ALLGATHER",
                  "MEMCPY_OUT_FUSION_BUFFER"],
        "small": ["QUEUE", "NEGOTIATE_ALLREDUCE", "RANK0_REDUCE", "MEMCPY_OUT_FUSION_BUFFER"],
        "medium": ["QUEUE", "NEGOTIATE_ALLREDUCE", "DOUBLING_ALLREDUCE"],
        "gathered": ["QUEUE", "NEGOTIATE_ALLGATHER", "RANK0_GATHER"],
    }
    for op, names in expected.items():
        spans = _phases(events, op)
        assert [e["name"] for e in spans] == names, (op, spans)
        for before, after in zip(spans, spans[1:]):  # back to back, no overlap (0.2 us rounding)
            assert before["ts"] + before["dur"] <= after["ts"] + 0.2, (op, before, after)
        assert all(e["dur"] >= 0 and e["tid"] == 0 for e in spans)
    # the ring phases of a 4 MiB op take real time; the grouped op's args say it moved two tensors
    ring = [e for e in _phases(events, "big") if e["name"].startswith("RING_")]
    assert sum(e["dur"] for e in ring) > 0
    assert {e["args"]["tensors"] for e in _phases(events, "fused") if "args" in e} == {2}
