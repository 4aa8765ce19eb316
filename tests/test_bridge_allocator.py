"""JAX's GPU allocator and the torch bridge: importing the bridge leaves the
environment alone; `configure_jax_allocator` is the explicit choice; the
bridge's first call applies the default only where nothing was chosen."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from torch_bridge import _runtime as rt  # noqa: E402
from torch_bridge import settings  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, **extra) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON")}
  env.update(extra)
  env["PYTHONPATH"] = os.pathsep.join(
      [_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
  return subprocess.run([sys.executable, "-c", code], env=env,
                        capture_output=True, text=True, timeout=120)


def test_importing_the_bridge_leaves_os_environ_unchanged():
  code = ("import json, os; before = dict(os.environ); "
          "import torch_bridge, torch_bridge.hf; "
          "after = dict(os.environ); "
          "print(json.dumps({k: [before.get(k), after.get(k)] for k in "
          "set(before) | set(after) if before.get(k) != after.get(k)}))")
  r = _python(code)
  assert r.returncode == 0, r.stderr
  assert json.loads(r.stdout.strip().splitlines()[-1]) == {}


def test_configure_jax_allocator_sets_the_default_unless_chosen():
  code = ("import os, torch_bridge; "
          "print(torch_bridge.configure_jax_allocator(), "
          "torch_bridge.configure_jax_allocator(), "
          "os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'))")
  r = _python(code)
  assert r.returncode == 0, r.stderr
  assert r.stdout.split() == ["True", "False", "false"]  # twice: harmless
  r = _python(code, XLA_PYTHON_CLIENT_MEM_FRACTION=".5")
  assert r.returncode == 0, r.stderr
  assert r.stdout.split() == ["False", "False", "None"]  # the user's wins


@pytest.fixture
def fresh_check(monkeypatch):
  for v in settings.ALLOCATOR_VARIABLES:
    monkeypatch.setenv(v, "")  # records the value to restore, then unsets
    monkeypatch.delenv(v)
  monkeypatch.setattr(rt, "_allocator_checked", False)
  monkeypatch.setattr("torch.cuda.is_available", lambda: True)
  monkeypatch.setattr(rt, "_announced", set())
  yield monkeypatch


def test_first_call_applies_the_default_when_nothing_was_chosen(fresh_check,
                                                                caplog):
  fresh_check.setattr("pallas_kernels.device.backends_initialised",
                      lambda: False)
  with caplog.at_level(logging.WARNING, logger="torch_bridge"):
    rt.check_jax_allocator()
    rt.check_jax_allocator()
  assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false"
  said = [r.getMessage() for r in caplog.records]
  assert len(said) == 1 and "configure_jax_allocator()" in said[0]


def test_first_call_respects_a_choice_and_warns_when_too_late(fresh_check,
                                                              caplog):
  fresh_check.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
  with caplog.at_level(logging.WARNING, logger="torch_bridge"):
    rt.check_jax_allocator()
  assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ
  assert not caplog.records
  fresh_check.delenv("XLA_PYTHON_CLIENT_ALLOCATOR")
  fresh_check.setattr(rt, "_allocator_checked", False)
  fresh_check.setattr("pallas_kernels.device.backends_initialised",
                      lambda: True)
  with caplog.at_level(logging.WARNING, logger="torch_bridge"):
    rt.check_jax_allocator()
  assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ
  assert [r for r in caplog.records if "preallocates 75%" in r.getMessage()]


def test_configure_jax_allocator_after_jax_started(fresh_check):
  """Too late: nothing to do without a GPU; an error naming the fix with
  one (JAX may hold 75% of it)."""
  import types

  import jax
  fresh_check.setattr("pallas_kernels.device.backends_initialised",
                      lambda: True)
  assert settings.configure_jax_allocator() is False  # CPU only: harmless
  assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ
  fresh_check.setattr(jax, "devices",
                      lambda *a: [types.SimpleNamespace(platform="gpu")])
  with pytest.raises(RuntimeError, match="before any JAX computation"):
    settings.configure_jax_allocator()
  assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ
