"""`jax_api.selfcheck`: the quick run passes on this machine, and the checker
notices a wrong function, a missing one, and an unknown name."""

from __future__ import annotations

import numpy as np
import pytest

import jax_api
from jax_api import selfcheck


def test_quick_selfcheck_passes(capsys):
  rc = selfcheck.main(["--quick"])
  out = capsys.readouterr().out
  assert rc == 0, out
  for name in ("fold_attn_func", "fold_attn_varlen_func", "interpret", "xla",
               "rel err out", "deterministic"):
    assert name in out, out
  assert out.strip().splitlines()[-1].startswith("PASS"), out
  assert " NO " not in out and "ERROR" not in out, out


def test_detects_a_wrong_function(monkeypatch, capsys):
  good = jax_api.fold_attn_func

  def off_by_one_percent(*a, **kw):
    out, lse = good(*a, **kw)
    return out * 1.01, lse

  monkeypatch.setattr(jax_api, "fold_attn_func", off_by_one_percent)
  rc = selfcheck.main(["--quick", "--backend", "xla",
                       "--function", "fold_attn_func"])
  out = capsys.readouterr().out
  assert rc == 1, out
  assert "!" in out and "worst: out" in out, out
  assert out.strip().splitlines()[-1].startswith("FAIL"), out


def test_missing_function_is_a_note(monkeypatch, capsys):
  monkeypatch.setattr(selfcheck, "REGISTRY", [
      selfcheck.Entry("fold_attn_not_there", selfcheck.dense_cases),
      selfcheck.Entry("fold_attn_func", None),
  ])
  rc = selfcheck.main(["--quick", "--backend", "xla"])
  out = capsys.readouterr().out
  assert "fold_attn_not_there: not in jax_api yet; skipped" in out, out
  assert "fold_attn_func: present, but has no selfcheck cases" in out, out
  assert rc == 1  # nothing was checked: no PASS


def test_unknown_function_name(capsys):
  assert selfcheck.main(["--function", "nope"]) == 2


def test_bad_backend_flag():
  with pytest.raises(SystemExit):
    selfcheck.main(["--backend", "cuda"])


def test_registry_names_the_planned_functions():
  names = [e.name for e in selfcheck.REGISTRY]
  assert names[:2] == ["fold_attn_func", "fold_attn_varlen_func"]
  assert "fold_attn_with_kvcache" in names
  assert "disentangled_attention" in names


def test_rel_err():
  inf = np.inf
  assert selfcheck._rel_err([1.0, 2.0], [1.0, 2.0]) == 0.0
  assert selfcheck._rel_err([1.0, 2.1], [1.0, 2.0]) == pytest.approx(0.05)
  assert selfcheck._rel_err([-inf, 1.0], [-inf, 1.0]) == 0.0
  assert selfcheck._rel_err([-inf, 1.0], [0.5, 1.0]) == inf
  assert selfcheck._rel_err([np.nan, 1.0], [0.5, 1.0]) == inf
  assert selfcheck._rel_err([1.0], [1.0, 2.0]) == inf
