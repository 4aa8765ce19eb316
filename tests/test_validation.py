"""Every rule of `jax_api._validation`, through the public entry points.

Each test calls `fold_attn_func` / `fold_attn_varlen_func` with one bad
argument and checks (a) the exception type (TypeError: wrong kind of thing,
ValueError: right kind, wrong value) and (b) that the message names the
argument *and* what was given. Validation runs before any computation, so
nothing here compiles a kernel; the few valid calls use backend="xla".
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_api import _validation as val
from jax_api import fold_attn_func, fold_attn_varlen_func

B, S, HQ, HKV, D = 2, 16, 4, 2, 32
T = 24  # packed tokens


def _dense(dtype=jnp.float32, b=B, sq=S, sk=S, hq=HQ, hkv=HKV, d=D):
  z = lambda *s: jnp.zeros(s, dtype)
  return z(b, sq, hq, d), z(b, sk, hkv, d), z(b, sk, hkv, d)


def _packed(dtype=jnp.float32, tq=T, tk=T, hq=HQ, hkv=HKV, d=D):
  z = lambda *s: jnp.zeros(s, dtype)
  return z(tq, hq, d), z(tk, hkv, d), z(tk, hkv, d)


CU = jnp.array([0, 10, 24], jnp.int32)


def _raises(exc, *fragments):
  """pytest.raises(exc) whose message contains every fragment (literal)."""
  pattern = "".join(f"(?=[\\s\\S]*{re.escape(str(f))})" for f in fragments)
  return pytest.raises(exc, match=pattern)


def dense(q, k, v, **kw):
  kw.setdefault("backend", "xla")
  return fold_attn_func(q, k, v, **kw)


def varlen(q, k, v, cu_q=CU, cu_k=None, mq=None, mk=None, **kw):
  kw.setdefault("backend", "xla")
  return fold_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, **kw)


# ----------------------------------------------------------------- sanity --


def test_valid_calls_pass():
  q, k, v = _dense()
  assert dense(q, k, v, causal=True).shape == q.shape
  q, k, v = _packed()
  assert varlen(q, k, v, causal=True).shape == q.shape


# ------------------------------------------------------------ rank/layout --


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_dense_rank(which):
  args = dict(zip("qkv", _dense()))
  args[which] = args[which][0]  # drop the batch axis: rank 3
  with _raises(ValueError, which, "rank 4", "[batch, seq_",
               str(tuple(args[which].shape))):
    dense(**args)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_varlen_rank(which):
  args = dict(zip("qkv", _packed()))
  args[which] = args[which][None]  # add a batch axis: rank 4
  with _raises(ValueError, which, "rank 3", "[total_",
               str(tuple(args[which].shape))):
    varlen(**args)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_array_input(which):
  args = dict(zip("qkv", _dense()))
  args[which] = np.asarray(args[which]).tolist()
  with _raises(TypeError, f"{which} must be an array", "list"):
    dense(**args)


# ----------------------------------------------------------------- dtypes --


@pytest.mark.parametrize("dtype", [np.float64, np.int32])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_unsupported_dtype(which, dtype):
  # NumPy arrays: jnp would silently turn float64 into float32 (x64 off).
  args = {n: np.asarray(x) for n, x in zip("qkv", _dense())}
  args[which] = args[which].astype(dtype)
  with _raises(TypeError, which, np.dtype(dtype).name, "bfloat16", "float32"):
    dense(**args)


def test_unsupported_dtype_varlen():
  q, k, v = (np.asarray(x, np.float64) for x in _packed())
  with _raises(TypeError, "q", "float64"):
    varlen(q, k, v)


def test_mixed_dtypes():
  q, k, v = _dense()
  with _raises(TypeError, "q, k and v", "q float32", "k bfloat16",
               "v float32"):
    dense(q, k.astype(jnp.bfloat16), v)
  with _raises(TypeError, "q, k and v", "v float16"):
    dense(q, k, v.astype(jnp.float16))


# ----------------------------------------------------------------- shapes --


def test_kv_shape_mismatch():
  q, k, v = _dense()
  v = jnp.zeros((B, S + 1, HKV, D))
  with _raises(ValueError, "k and v", str(tuple(k.shape)), str(v.shape)):
    dense(q, k, v)
  q, k, v = _packed()
  v = jnp.zeros((T, HKV, D + 32))
  with _raises(ValueError, "k and v", str(v.shape)):
    varlen(q, k, v)


def test_batch_mismatch():
  q, _, _ = _dense()
  _, k, v = _dense(b=B + 1)
  with _raises(ValueError, "batch", f"q batch {B}", f"k batch {B + 1}"):
    dense(q, k, v)


def test_head_dim_mismatch():
  q, _, _ = _dense()
  _, k, v = _dense(d=64)
  with _raises(ValueError, "head_dim", "64", str(D)):
    dense(q, k, v)


@pytest.mark.parametrize("d", [288, 512])
def test_head_dim_too_large(d):
  q, k, v = _dense(d=d, sq=4, sk=4)
  with _raises(ValueError, "head_dim", str(d), "256"):
    dense(q, k, v)


def test_gqa_divisibility():
  q, k, v = _dense(hq=6, hkv=4)
  with _raises(ValueError, "heads_q", "heads_kv", "6", "4"):
    dense(q, k, v)
  q, k, v = _packed(hq=3, hkv=2)
  with _raises(ValueError, "heads_q", "(3", "(2"):
    varlen(q, k, v)


def test_empty_sequence():
  q, k, v = _dense(sq=0)
  with _raises(ValueError, "sequence lengths", "(2, 0, 4, 32)"):
    dense(q, k, v)


# ------------------------------------------------------------ window_size --


@pytest.mark.parametrize("window", [4, (4,), (1, 2, 3), (1.0, 2), "(-1,-1)",
                                    None])
def test_window_wrong_type(window):
  q, k, v = _dense()
  with _raises(TypeError, "window_size", repr(window)):
    dense(q, k, v, window_size=window)


@pytest.mark.parametrize("window", [(-2, 0), (3, -5)])
def test_window_bad_values(window):
  q, k, v = _dense()
  with _raises(ValueError, "window_size", ">= -1", repr(window)):
    dense(q, k, v, window_size=window)
  q, k, v = _packed()
  with _raises(ValueError, "window_size", repr(window)):
    varlen(q, k, v, window_size=window)


# ---------------------------------------------------------------- softcap --


def test_softcap_negative():
  q, k, v = _dense()
  with _raises(ValueError, "softcap", ">= 0", "-1.5"):
    dense(q, k, v, softcap=-1.5)


def test_softcap_nan():
  q, k, v = _dense()
  with _raises(ValueError, "softcap", "nan"):
    dense(q, k, v, softcap=float("nan"))


@pytest.mark.parametrize("softcap", ["30", None, [30.0]])
def test_softcap_wrong_type(softcap):
  q, k, v = _dense()
  with _raises(TypeError, "softcap", repr(softcap)):
    dense(q, k, v, softcap=softcap)


# ---------------------------------------------------------- softmax_scale --


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan")])
def test_softmax_scale_not_positive(scale):
  q, k, v = _dense()
  with _raises(ValueError, "softmax_scale", "> 0", str(scale)):
    dense(q, k, v, softmax_scale=scale)
  q, k, v = _packed()
  with _raises(ValueError, "softmax_scale", str(scale)):
    varlen(q, k, v, softmax_scale=scale)


def test_softmax_scale_wrong_type():
  q, k, v = _dense()
  with _raises(TypeError, "softmax_scale", "'0.1'"):
    dense(q, k, v, softmax_scale="0.1")


# ------------------------------------------------------------------ sinks --


@pytest.mark.parametrize("shape", [(HQ + 1,), (HKV,), (1, HQ), ()])
def test_sinks_wrong_shape(shape):
  q, k, v = _dense()
  sinks = jnp.zeros(shape, jnp.float32)
  with _raises(ValueError, "sinks", str(shape)):
    dense(q, k, v, sinks=sinks)


def test_sinks_wrong_shape_names_heads_q():
  q, k, v = _packed()
  with _raises(ValueError, "sinks", "[heads_q]", f"[{HQ}]", f"({HKV},)"):
    varlen(q, k, v, sinks=jnp.zeros((HKV,)))


@pytest.mark.parametrize("dtype", [np.int32, np.float64, np.bool_])
def test_sinks_wrong_dtype(dtype):
  q, k, v = _dense()
  sinks = np.zeros((HQ,), dtype)
  with _raises(TypeError, "sinks", np.dtype(dtype).name):
    dense(q, k, v, sinks=sinks)


def test_sinks_not_an_array():
  q, k, v = _dense()
  with _raises(TypeError, "sinks", "list"):
    dense(q, k, v, sinks=[0.0] * HQ)


# ------------------------------------------------------------ segment_ids --


@pytest.mark.parametrize("shape", [(B, S + 1), (B + 1, S), (B * S,)])
def test_segment_ids_wrong_shape(shape):
  q, k, v = _dense()
  seg = jnp.zeros(shape, jnp.int32)
  with _raises(ValueError, "segment_ids", str(shape)):
    dense(q, k, v, segment_ids=seg)


def test_segment_ids_pair_wrong_shape():
  q, k, v = _dense(sk=2 * S)
  good_q = jnp.zeros((B, S), jnp.int32)
  with _raises(ValueError, "segment_ids (keys)", f"[{B}, {2 * S}]",
               str((B, S))):
    dense(q, k, v, segment_ids=(good_q, jnp.zeros((B, S), jnp.int32)))
  # One array for queries and keys needs seq_q == seq_k.
  with _raises(ValueError, "segment_ids (keys)"):
    dense(q, k, v, segment_ids=good_q)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bool_])
def test_segment_ids_wrong_dtype(dtype):
  q, k, v = _dense()
  seg = jnp.zeros((B, S), dtype)
  with _raises(TypeError, "segment_ids", "integer", jnp.dtype(dtype).name):
    dense(q, k, v, segment_ids=seg)


def test_segment_ids_wrong_container():
  q, k, v = _dense()
  seg = jnp.zeros((B, S), jnp.int32)
  with _raises(TypeError, "segment_ids", "pair", "tuple of length 3"):
    dense(q, k, v, segment_ids=(seg, seg, seg))
  with _raises(TypeError, "segment_ids", "str"):
    dense(q, k, v, segment_ids="abc")


def test_segment_ids_valid_pair_passes():
  q, k, v = _dense(sk=2 * S)
  segs = (jnp.zeros((B, S), jnp.int32), jnp.zeros((B, 2 * S), jnp.int32))
  assert dense(q, k, v, segment_ids=segs).shape == q.shape


# ------------------------------------------------------------- cu_seqlens --


@pytest.mark.parametrize("arg", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_wrong_rank(arg):
  q, k, v = _packed()
  bad = CU[None]
  kw = {"cu_q": CU, "cu_k": CU, ("cu_q" if arg.endswith("q") else "cu_k"): bad}
  with _raises(ValueError, arg, "rank 1", str(tuple(bad.shape))):
    varlen(q, k, v, **kw)


@pytest.mark.parametrize("arg", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_float_dtype(arg):
  q, k, v = _packed()
  bad = CU.astype(jnp.float32)
  kw = {"cu_q": CU, "cu_k": CU, ("cu_q" if arg.endswith("q") else "cu_k"): bad}
  with _raises(TypeError, arg, "integer", "float32"):
    varlen(q, k, v, **kw)


def test_cu_seqlens_not_an_array():
  q, k, v = _packed()
  with _raises(TypeError, "cu_seqlens_q", "list"):
    varlen(q, k, v, cu_q=[0, 10, 24])


def test_cu_seqlens_first_not_zero():
  q, k, v = _packed()
  with _raises(ValueError, "cu_seqlens_q[0]", "must be 0", "got 2"):
    varlen(q, k, v, cu_q=jnp.array([2, 10, 24], jnp.int32))
  with _raises(ValueError, "cu_seqlens_k[0]", "got 1"):
    varlen(q, k, v, cu_k=jnp.array([1, 10, 24], jnp.int32))


def test_cu_seqlens_decreasing():
  q, k, v = _packed()
  with _raises(ValueError, "cu_seqlens_q", "non-decreasing", "[0, 12, 8]"):
    varlen(q, k, v, cu_q=jnp.array([0, 12, 8], jnp.int32))


def test_cu_seqlens_last_exceeds_total():
  q, k, v = _packed(tk=20)
  with _raises(ValueError, "cu_seqlens_q[-1]", str(T + 1), str(T)):
    varlen(q, k, v, cu_q=jnp.array([0, 10, T + 1], jnp.int32),
           cu_k=jnp.array([0, 10, 20], jnp.int32))
  # cu_seqlens_k defaults to cu_seqlens_q and is checked against total_k.
  with _raises(ValueError, "cu_seqlens_k[-1]", str(T), "20"):
    varlen(q, k, v, cu_q=CU)


@pytest.mark.parametrize("cu", [[0], []])
def test_cu_seqlens_too_few_entries(cu):
  q, k, v = _packed()
  cu = jnp.array(cu, jnp.int32)
  with _raises(ValueError, "cu_seqlens_q", "at least 2", str(tuple(cu.shape))):
    varlen(q, k, v, cu_q=cu)


def test_cu_seqlens_count_mismatch():
  q, k, v = _packed()
  cu_k = jnp.array([0, 8, 16, 24], jnp.int32)
  with _raises(ValueError, "cu_seqlens_q", "cu_seqlens_k", "(3,)", "(4,)"):
    varlen(q, k, v, cu_q=CU, cu_k=cu_k)


def test_cu_seqlens_traced_skips_value_checks():
  # Under jit only static properties (rank, dtype, length) can be checked.
  q, k, v = _packed()
  f = jax.jit(lambda cu: varlen(q, k, v, cu_q=cu))
  assert f(CU).shape == q.shape
  with _raises(TypeError, "cu_seqlens_q", "float32"):
    f(CU.astype(jnp.float32))


# ------------------------------------------------------------- max_seqlen --
# max_seqlen_* only size the Pallas kernel's grid, so they are checked on
# the kernel path ("interpret" here); validation fails before any compile.


def test_max_seqlen_too_small():
  q, k, v = _packed()
  with _raises(ValueError, "max_seqlen_q", "= 8", "(14)"):
    varlen(q, k, v, mq=8, backend="interpret")
  with _raises(ValueError, "max_seqlen_k", "= 10", "(14)"):
    varlen(q, k, v, mq=14, cu_k=CU, mk=10, backend="interpret")


@pytest.mark.parametrize("bad", [0, -3])
def test_max_seqlen_not_positive(bad):
  q, k, v = _packed()
  with _raises(ValueError, "max_seqlen_q", repr(bad)):
    varlen(q, k, v, mq=bad, backend="interpret")


@pytest.mark.parametrize("bad", [14.0, "14"])
def test_max_seqlen_wrong_type(bad):
  q, k, v = _packed()
  with _raises(TypeError, "max_seqlen_q", repr(bad)):
    varlen(q, k, v, mq=bad, backend="interpret")


# ---------------------------------------------------------------- backend --


@pytest.mark.parametrize("backend", ["cuda", "XLA", "", None, 1])
def test_backend_unknown(backend):
  q, k, v = _dense()
  with _raises(ValueError, "backend", repr(backend), "'auto'", "'xla'"):
    dense(q, k, v, backend=backend)
  q, k, v = _packed()
  with _raises(ValueError, "backend", repr(backend)):
    varlen(q, k, v, backend=backend)


def test_backend_pallas_on_cpu():
  platform = jax.devices()[0].platform
  if platform == "gpu":
    pytest.skip("a GPU is present")
  q, k, v = _dense()
  with _raises(ValueError, "pallas", repr(platform), "interpret"):
    dense(q, k, v, backend="pallas")
  q, k, v = _packed()
  with _raises(ValueError, "pallas", repr(platform)):
    varlen(q, k, v, backend="pallas")


# ------------------------------------------------------------ conventions --


def test_validation_runs_before_backend_choice():
  # A bad argument is reported as such even with an unusable backend.
  q, k, v = _dense()
  with _raises(ValueError, "window_size"):
    dense(q, k, v, window_size=(-3, 0), backend="nonsense")


def test_supported_dtype_table():
  assert {str(d) for d in val.SUPPORTED_DTYPES} == {
      "bfloat16", "float16", "float32"}
  assert max(val.SUPPORTED_HEAD_DIMS) == val.MAX_HEAD_DIM == 256
