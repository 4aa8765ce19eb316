"""`jax_api._backend.resolve_backend`: what each request resolves to on this
(CPU) machine and on a faked GPU, and that "auto" logs its choice once."""

from __future__ import annotations

import logging

import jax
import pytest

from jax_api import _backend
from jax_api._backend import BACKENDS, resolve_backend

ON_GPU = jax.devices()[0].platform == "gpu"
cpu_only = pytest.mark.skipif(ON_GPU, reason="checks the CPU behaviour")


@pytest.fixture(autouse=True)
def fresh_announcements():
  """Each test starts as a fresh process would: nothing announced yet."""
  saved = set(_backend._announced)
  _backend._announced.clear()
  yield
  _backend._announced.clear()
  _backend._announced.update(saved)


@pytest.fixture
def fake_gpu(monkeypatch):
  """fake_gpu((major, minor) | None) makes that the device's capability."""
  def install(cc):
    monkeypatch.setattr(_backend, "_gpu_capability", lambda: cc)
  return install


def _records(caplog):
  return [r for r in caplog.records if r.name == "jax_api"]


def test_backends_tuple():
  assert BACKENDS == ("auto", "pallas", "interpret", "xla")


@cpu_only
def test_auto_on_cpu_is_xla_and_logs_once(caplog):
  with caplog.at_level(logging.WARNING, logger="jax_api"):
    for _ in range(5):
      assert resolve_backend("auto") == "xla"
  recs = _records(caplog)
  assert len(recs) == 1, [r.getMessage() for r in recs]
  msg = recs[0].getMessage()
  assert recs[0].levelno == logging.WARNING
  assert "XLA" in msg and "no NVIDIA GPU" in msg and "interpret" in msg


@cpu_only
def test_auto_logs_once_per_kernel(caplog):
  with caplog.at_level(logging.WARNING, logger="jax_api"):
    for _ in range(3):
      resolve_backend("auto", kernel="fold_attn_func")
      resolve_backend("auto", kernel="fold_attn_varlen_func")
  msgs = [r.getMessage() for r in _records(caplog)]
  assert len(msgs) == 2, msgs
  assert "fold_attn_func" in msgs[0] and "fold_attn_varlen_func" in msgs[1]


@cpu_only
def test_auto_through_public_api_logs_once(caplog):
  import jax.numpy as jnp
  from jax_api import fold_attn_func
  q = jnp.zeros((1, 8, 2, 32))
  with caplog.at_level(logging.WARNING, logger="jax_api"):
    for _ in range(3):
      fold_attn_func(q, q, q)  # backend="auto"
  msgs = [r.getMessage() for r in _records(caplog)]
  assert len(msgs) == 1 and "fold_attn_func" in msgs[0], msgs


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_explicit_backends_pass_through_silently(backend, caplog):
  with caplog.at_level(logging.DEBUG, logger="jax_api"):
    assert resolve_backend(backend) == backend
  assert not _records(caplog)


@cpu_only
def test_pallas_on_cpu_raises():
  with pytest.raises(ValueError, match=r"pallas[\s\S]*'cpu'"):
    resolve_backend("pallas")


@pytest.mark.parametrize("bad", ["gpu", "triton", "Auto", "", None, 3])
def test_unknown_backend(bad):
  with pytest.raises(ValueError, match=r"backend must be one of"):
    resolve_backend(bad)


def test_fake_ampere_plus_auto_is_pallas(fake_gpu, caplog):
  fake_gpu((9, 0))
  with caplog.at_level(logging.WARNING, logger="jax_api"):
    assert resolve_backend("auto") == "pallas"
    assert resolve_backend("auto") == "pallas"
  msgs = [r.getMessage() for r in _records(caplog)]
  assert len(msgs) == 1 and "Pallas" in msgs[0] and "9.0" in msgs[0], msgs
  assert resolve_backend("pallas") == "pallas"
  assert resolve_backend("interpret") == "interpret"
  assert resolve_backend("xla") == "xla"


@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (10, 0)])
def test_fake_capability_boundary(fake_gpu, cc):
  fake_gpu(cc)
  assert resolve_backend("auto") == "pallas"
  assert resolve_backend("pallas") == "pallas"


def test_fake_turing_auto_is_xla(fake_gpu, caplog):
  fake_gpu((7, 5))
  with caplog.at_level(logging.WARNING, logger="jax_api"):
    assert resolve_backend("auto") == "xla"
    assert resolve_backend("auto") == "xla"
  msgs = [r.getMessage() for r in _records(caplog)]
  assert len(msgs) == 1, msgs
  assert "7.5" in msgs[0] and "8.0" in msgs[0] and "XLA" in msgs[0]


def test_fake_turing_pallas_strict_raises(fake_gpu):
  fake_gpu((7, 5))
  with pytest.raises(ValueError, match=r"pallas[\s\S]*8\.0[\s\S]*7\.5"):
    resolve_backend("pallas")
  assert resolve_backend("interpret") == "interpret"


def test_fake_no_gpu_pallas_names_platform(fake_gpu):
  fake_gpu(None)
  platform = jax.devices()[0].platform
  with pytest.raises(ValueError, match=rf"pallas[\s\S]*'{platform}'"):
    resolve_backend("pallas")


def test_real_gpu_capability_on_this_machine():
  cc = _backend._gpu_capability()
  if ON_GPU:
    assert cc is None or (isinstance(cc, tuple) and len(cc) == 2)
  else:
    assert cc is None
