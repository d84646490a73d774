"""The profile summary of the training benchmark: synchronizes and copies counted per thread, the device's busy share."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")  # the profiler is torch's

from ringcomm.bench import _profile  # noqa: E402


def _ev(name: str, start: float, end: float, thread: int, device: str = "DeviceType.CPU") -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), thread=thread,
                           device_type=device)


def test_the_summary_counts_waits_and_copies_per_thread_and_the_device_busy_share() -> None:
    events = [
        _ev("aten::add", 0, 100, 1),
        _ev("cudaStreamSynchronize", 10, 20, 7),  # a hook's thread waiting for the GPU
        _ev("cudaStreamSynchronize", 30, 40, 7),
        _ev("cudaMemcpyAsync", 50, 51, 1),
        _ev("Memcpy DtoH (Device -> Pinned)", 60, 70, 0, "DeviceType.CUDA"),
        _ev("volta_sgemm", 70, 90, 0, "DeviceType.CUDA"),
    ]
    s = _profile.summarize(events, steps=2)
    assert s["threads"] == {"0": {"Memcpy DtoH (Device -> Pinned)": 1}, "1": {"cudaMemcpyAsync": 1},
                            "7": {"cudaStreamSynchronize": 2}}
    assert s["waits_per_step"] == 1.0 and s["copies_per_step"] == 1.0
    assert s["span_us"] == 100 and s["device_busy_share"] == 0.3


def test_an_empty_profile_is_all_zeros() -> None:
    s = _profile.summarize([], steps=3)
    assert s["span_us"] == 0.0 and s["device_busy_share"] == 0.0 and s["threads"] == {}
