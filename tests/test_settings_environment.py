"""`pallas_kernels.settings.from_environment` reads the FOLDAX_* variables on
every call through a fast path; it must see exactly what `os.environ` says."""

from __future__ import annotations

import os

import pytest

from pallas_kernels import settings


def test_the_fast_reader_agrees_with_os_environ(monkeypatch):
  monkeypatch.setenv("FOLDAX_DQ_MODE", "atomic")
  monkeypatch.setenv("FOLDAX_DEBERTA_SPLIT_TILES", "0")
  monkeypatch.delenv("FOLDAX_BLOCK_TABLE", raising=False)
  assert settings._read_environment() == tuple(
      os.environ.get(v) if os.name != "posix" else
      (None if os.environ.get(v) is None else os.fsencode(os.environ[v]))
      for v in settings._VARIABLES)


def test_a_change_of_the_environment_is_seen_by_the_next_call(monkeypatch):
  monkeypatch.delenv("FOLDAX_DQ_MODE", raising=False)
  assert settings.current().dq_mode == "recompute"
  monkeypatch.setenv("FOLDAX_DQ_MODE", "atomic")
  assert settings.current().dq_mode == "atomic"
  if hasattr(os, "environb"):  # the bytes view writes the same mapping
    monkeypatch.setitem(os.environb, b"FOLDAX_DQ_MODE", b"recompute")
    assert settings.current().dq_mode == "recompute"
  monkeypatch.setenv("FOLDAX_DEBERTA_BLOCKS", "/tmp/t\u00e4bles.json")
  assert settings.current().deberta_blocks == "/tmp/t\u00e4bles.json"
  monkeypatch.setenv("FOLDAX_DQ_MODE", "sometimes")
  with pytest.raises(ValueError, match="FOLDAX_DQ_MODE"):
    settings.current()


def test_use_overrides_the_environment(monkeypatch):
  monkeypatch.setenv("FOLDAX_DQ_MODE", "atomic")
  with settings.use(settings.KernelSettings(dq_mode="recompute")):
    assert settings.current().dq_mode == "recompute"
  assert settings.current().dq_mode == "atomic"
