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
