"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest


@pytest.fixture
def fake_h200(monkeypatch):
  """Lets Pallas lower for CUDA (sm_90, an H200) on a machine without a GPU:
  its GPU query answers with an H200's description."""
  from jax._src.pallas.triton import gpu_info
  from jax._src.pallas.triton import pallas_call_registration as pcr
  monkeypatch.setattr(
      pcr.gpu_info_lib, "get_gpu_info",
      lambda *a, **k: gpu_info.GpuInfo(gpu_version=gpu_info.GpuVersion.H200,
                                       arch_name="9.0",
                                       compute_capability=90))


# Hypothesis profiles. "foldax-ci" (default): no per-example deadline (the
# first example of a configuration compiles), each test's own example count.
# "foldax-large": ten times the examples (test_properties.py scales its
# counts by max_examples / 100); run by hand:
#   FOLDAX_HYPOTHESIS_PROFILE=foldax-large pytest tests/test_properties.py
def _hypothesis_profiles():
  import os

  from hypothesis import HealthCheck, settings
  common = dict(deadline=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
  settings.register_profile("foldax-ci", max_examples=100, **common)
  settings.register_profile("foldax-large", max_examples=1000, **common)
  settings.load_profile(os.environ.get("FOLDAX_HYPOTHESIS_PROFILE",
                                       "foldax-ci"))


_hypothesis_profiles()
