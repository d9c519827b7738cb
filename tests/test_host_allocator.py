"""The glibc allocator tuning is opt-out and never raises."""

from __future__ import annotations

from batchgen.engine import host_allocator


def test_tuning_can_be_disabled(monkeypatch):
    monkeypatch.setattr(host_allocator, "_tuned", False)
    monkeypatch.setenv("BATCHGEN_TUNE_MALLOC", "0")
    assert host_allocator.tune_glibc_malloc() is False


def test_tuning_applies_once(monkeypatch):
    monkeypatch.setattr(host_allocator, "_tuned", False)
    monkeypatch.delenv("BATCHGEN_TUNE_MALLOC", raising=False)
    first = host_allocator.tune_glibc_malloc()
    assert host_allocator.tune_glibc_malloc() is False  # second call: nothing to do
    assert first in (True, False)  # False only off glibc
