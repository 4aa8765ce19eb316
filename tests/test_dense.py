"""Dense/varlen flash attention (Pallas kernel in interpret mode) against the
float32 reference: forward, LSE and every gradient, plus determinism and
batch invariance. GPU twins of the key checks are marked `gpu`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_api import fold_attn_func, fold_attn_varlen_func
from pallas_kernels.reference import (attention_reference,
                                      varlen_attention_reference)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
ON_GPU = jax.devices()[0].platform == "gpu"


def _rand(rng, shape, dtype):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _check_against_reference(*, b, sq, sk, hq, hkv, d, dtype=jnp.float32,
                             causal=False, window=(-1, -1), sinks=False,
                             softcap=0.0, scale=None, segments=False,
                             backend="interpret", seed=0):
  rng = np.random.default_rng(seed)
  q = _rand(rng, (b, sq, hq, d), dtype)
  k = _rand(rng, (b, sk, hkv, d), dtype)
  v = _rand(rng, (b, sk, hkv, d), dtype)
  do = _rand(rng, (b, sq, hq, d), dtype)
  dlse = _rand(rng, (b, hq, sq), jnp.float32)
  sink = _rand(rng, (hq,), jnp.float32) if sinks else None
  seg = None
  if segments:
    assert sq == sk
    cut = sorted(rng.integers(1, sq, size=2))
    ids = np.zeros((b, sq), np.int32)
    ids[:, cut[0]:] = 1
    ids[:, cut[1]:] = 2
    seg = jnp.asarray(ids)
  opts = dict(causal=causal, window_size=window, softcap=softcap,
              softmax_scale=scale)

  def ours(q, k, v, s):
    return fold_attn_func(q, k, v, sinks=s, segment_ids=seg, return_lse=True,
                          backend=backend, **opts)

  def ref(q, k, v, s):
    return attention_reference(q, k, v, sinks=s, segment_ids=seg, **opts)

  (out, lse), vjp = jax.vjp(ours, q, k, v, sink)
  f32 = lambda x: None if x is None else x.astype(jnp.float32)
  (rout, rlse), rvjp = jax.vjp(ref, f32(q), f32(k), f32(v), sink)
  assert out.dtype == q.dtype and out.shape == q.shape
  assert not jnp.any(jnp.isnan(out))
  tol = TOL[dtype]
  assert _rel(out, rout) < tol
  finite = jnp.isfinite(rlse)
  assert bool(jnp.all(jnp.isfinite(lse) == finite))
  np.testing.assert_allclose(np.where(finite, lse, 0), np.where(finite, rlse, 0),
                             atol=tol * 10, rtol=tol)
  dlse_used = jnp.where(finite, dlse, 0.0)
  grads = vjp((do, dlse_used))
  rgrads = rvjp((f32(do), dlse_used))
  for name, g, rg in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads):
    if rg is None:
      continue
    assert g.dtype == (sink.dtype if name == "dsinks" else dtype), name
    assert not jnp.any(jnp.isnan(g)), name
    assert _rel(g, rg) < 2 * tol, (name, _rel(g, rg))
  return out, grads


# Each case: shapes and options; lengths are deliberately not multiples of the
# 16-row interpret tiles, and several have seq_q != seq_k.
CASES = {
    "plain": dict(b=2, sq=37, sk=37, hq=2, hkv=2, d=32),
    "causal_sq_lt_sk": dict(b=1, sq=21, sk=45, hq=2, hkv=2, d=32, causal=True),
    "causal_sq_gt_sk_masked_rows": dict(b=1, sq=40, sk=19, hq=4, hkv=1, d=32,
                                        causal=True),
    "gqa4_window": dict(b=1, sq=50, sk=50, hq=8, hkv=2, d=32, causal=True,
                        window=(9, -1)),
    "gqa8_two_sided_window": dict(b=1, sq=33, sk=41, hq=8, hkv=1, d=32,
                                  window=(6, 4)),
    "sinks_softcap_scale": dict(b=2, sq=23, sk=30, hq=4, hkv=2, d=32,
                                causal=True, sinks=True, softcap=3.0,
                                scale=0.3),
    "segments": dict(b=2, sq=40, sk=40, hq=2, hkv=1, d=32, segments=True,
                     causal=True),
    "head_dim_48_padded": dict(b=1, sq=20, sk=20, hq=2, hkv=2, d=48),
    "head_dim_96": dict(b=1, sq=17, sk=17, hq=2, hkv=1, d=96, causal=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference_fp32(name):
  _check_against_reference(**CASES[name])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_matches_reference_half(dtype):
  _check_against_reference(b=1, sq=35, sk=35, hq=4, hkv=2, d=64, dtype=dtype,
                           causal=True, sinks=True)


@pytest.mark.parametrize("mode", ["atomic", "recompute"])
def test_both_dq_reductions(mode, monkeypatch):
  monkeypatch.setenv("FOLDAX_DQ_MODE", mode)
  _check_against_reference(b=1, sq=29, sk=36, hq=4, hkv=2, d=32, causal=True,
                           window=(20, -1), sinks=True, seed=3)


def test_xla_backend_through_public_api():
  _check_against_reference(**CASES["sinks_softcap_scale"], backend="xla")


def _varlen_case(dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  lens_q = [5, 17, 1, 23]
  lens_k = [9, 17, 4, 20]
  cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
  cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
  tq, tk = int(cu_q[-1]) + 3, int(cu_k[-1]) + 2  # tails outside sequences
  q = _rand(rng, (tq, 4, 32), dtype)
  k = _rand(rng, (tk, 2, 32), dtype)
  v = _rand(rng, (tk, 2, 32), dtype)
  do = _rand(rng, (tq, 4, 32), dtype)
  return q, k, v, do, jnp.asarray(cu_q), jnp.asarray(cu_k)


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_varlen_matches_reference(backend):
  q, k, v, do, cu_q, cu_k = _varlen_case()
  opts = dict(causal=True, window_size=(7, -1))
  ours = lambda q, k, v: fold_attn_varlen_func(q, k, v, cu_q, cu_k,
                                               backend=backend, **opts)
  ref = lambda q, k, v: varlen_attention_reference(q, k, v, cu_q, cu_k,
                                                   **opts)[0]
  out, vjp = jax.vjp(ours, q, k, v)
  rout, rvjp = jax.vjp(ref, q, k, v)
  assert _rel(out, rout) < 2e-5
  assert bool(jnp.all(out[int(cu_q[-1]):] == 0))  # tail rows are zeros
  grads = vjp(do)
  for g, rg in zip(grads, rvjp(do)):
    assert _rel(g, rg) < 4e-5
  dq, dk, dv = grads
  assert bool(jnp.all(dq[int(cu_q[-1]):] == 0))
  assert bool(jnp.all(dk[int(cu_k[-1]):] == 0))
  assert bool(jnp.all(dv[int(cu_k[-1]):] == 0))


def _grads(fn, *args):
  out, vjp = jax.vjp(fn, *args[:-1])
  return (out,) + tuple(vjp(args[-1]))


GRAD_NAMES = ("out", "dq", "dk", "dv")


def _bit_mismatches(what, got, want, names=GRAD_NAMES):
  """One line per array of `got` whose bits differ from `want`'s: its name,
  how many elements differ, and the largest difference."""
  lines = []
  for name, a, b in zip(names, got, want):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
      lines.append(f"{what}: {name} is {a.dtype}{list(a.shape)}, expected "
                   f"{b.dtype}{list(b.shape)}")
      continue
    u = f"u{a.dtype.itemsize}"
    diff = a.view(u) != b.view(u)
    n = int(diff.sum())
    if n:
      d = np.abs(a.astype(np.float64) - b.astype(np.float64))[diff]
      first = tuple(int(i) for i in np.argwhere(diff)[0])
      lines.append(f"{what}: {name} differs in {n} of {a.size} elements "
                   f"(first at {first}, max |diff| {np.nanmax(d):.3g})")
  return lines


def _assert_same_bits(what, got, want, names=GRAD_NAMES):
  lines = _bit_mismatches(what, got, want, names)
  assert not lines, "\n".join(lines)


@pytest.mark.parametrize("mode", ["atomic", "recompute"])
def test_backward_bitwise_repeatable_20_runs(mode, monkeypatch):
  monkeypatch.setenv("FOLDAX_DQ_MODE", mode)
  rng = np.random.default_rng(7)
  q = _rand(rng, (2, 40, 4, 32), jnp.bfloat16)
  k = _rand(rng, (2, 40, 2, 32), jnp.bfloat16)
  v = _rand(rng, (2, 40, 2, 32), jnp.bfloat16)
  do = _rand(rng, (2, 40, 4, 32), jnp.bfloat16)
  fn = jax.jit(lambda q, k, v, do: _grads(
      functools.partial(fold_attn_func, causal=True, backend="interpret"),
      q, k, v, do))
  first = fn(q, k, v, do)
  for i in range(19):
    _assert_same_bits(f"run {i + 2} vs run 1", fn(q, k, v, do), first)


@pytest.mark.parametrize("mode", ["atomic", "recompute"])
def test_sequence_bits_independent_of_batch_and_packing(mode, monkeypatch):
  """A sequence alone, inside a padded batch, and packed with others through
  the varlen API gives identical output and gradient bits."""
  monkeypatch.setenv("FOLDAX_DQ_MODE", mode)
  rng = np.random.default_rng(11)
  s, hq, hkv, d = 37, 4, 2, 32
  dtype = jnp.bfloat16
  q, do = (_rand(rng, (3, s, hq, d), dtype) for _ in range(2))
  k, v = (_rand(rng, (3, s, hkv, d), dtype) for _ in range(2))
  opts = dict(causal=True, backend="interpret")

  alone = _grads(functools.partial(fold_attn_func, **opts),
                 q[1:2], k[1:2], v[1:2], do[1:2])
  batched = _grads(functools.partial(fold_attn_func, **opts), q, k, v, do)
  _assert_same_bits("batched vs alone", [x[1] for x in batched],
                    [x[0] for x in alone])

  # Pack sequence 1 between two others of different lengths.
  other_q = _rand(rng, (13, hq, d), dtype)
  other_k = _rand(rng, (13, hkv, d), dtype)
  tail_q = _rand(rng, (22, hq, d), dtype)
  tail_k = _rand(rng, (22, hkv, d), dtype)
  pq = jnp.concatenate([other_q, q[1], tail_q])
  pk = jnp.concatenate([other_k, k[1], tail_k])
  pv = jnp.concatenate([other_k[::-1], v[1], tail_k[::-1]])
  pdo = jnp.concatenate([other_q[::-1], do[1], tail_q[::-1]])
  cu = jnp.array([0, 13, 13 + s, 13 + s + 22], jnp.int32)
  packed = _grads(functools.partial(fold_attn_varlen_func, cu_seqlens_q=cu,
                                    **opts), pq, pk, pv, pdo)
  _assert_same_bits("packed vs alone", [x[13:13 + s] for x in packed],
                    [x[0] for x in alone])


def test_grid_exponent_matches_frexp():
  """The atomic dQ's in-kernel grid exponent (float bits) is jnp.frexp's,
  clipped; pow2 builds exact powers of two."""
  from pallas_kernels.flash import preprocess as pre
  x = jnp.array([0.0, 1e-45, 1e-38, 2.0**-126, 0.3, 0.5, 1.0, 1.5, 2.0,
                 3e5, 2.0**100, 3e38, np.inf, np.nan], jnp.float32)
  want = jnp.clip(jnp.frexp(x)[1], pre.E_MIN, pre.E_MAX)
  e = pre._exponent(x)
  np.testing.assert_array_equal(np.asarray(e), np.asarray(want))
  inside = jnp.isfinite(x) & (x <= 2.0 ** pre.E_MAX)
  assert bool(jnp.all(jnp.where(inside, x, 0) <= pre.pow2(e)))
  e = jnp.arange(pre.E_MIN, pre.E_MAX + 1, dtype=jnp.int32)
  for d in (e - pre.DQ_GRID_BITS, pre.DQ_GRID_BITS - e):
    np.testing.assert_array_equal(np.asarray(pre.pow2(d)),
                                  np.ldexp(np.float32(1), np.asarray(d)))


def test_transforms_jit_vmap_checkpoint_grad():
  rng = np.random.default_rng(5)
  q = _rand(rng, (3, 2, 19, 2, 32), jnp.float32)  # extra leading axis
  k = _rand(rng, (3, 2, 19, 1, 32), jnp.float32)
  v = _rand(rng, (3, 2, 19, 1, 32), jnp.float32)
  attn = functools.partial(fold_attn_func, causal=True, backend="interpret")
  loss = lambda q, k, v: jnp.sum(jnp.sin(jax.vmap(attn)(q, k, v)))
  g = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k, v)
  ref_attn = lambda q, k, v: attention_reference(q, k, v, causal=True)[0]
  rloss = lambda q, k, v: jnp.sum(jnp.sin(jax.vmap(ref_attn)(q, k, v)))
  rg = jax.grad(rloss, argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g, rg):
    assert _rel(a, b) < 2e-5


def test_static_options_do_not_recompile():
  rng = np.random.default_rng(2)
  q = _rand(rng, (1, 16, 2, 32), jnp.float32)
  fn = jax.jit(lambda q: fold_attn_func(q, q, q, causal=True,
                                        window_size=(4, -1), softcap=2.0,
                                        backend="interpret"))
  fn(q)
  n = fn._cache_size()
  fn(q + 1.0)
  fn(q * 2.0)
  assert fn._cache_size() == n


def test_lowers_for_triton_on_cpu(fake_h200):
  """The kernels lower to Triton IR (what the GPU compiles) on any machine."""
  from pallas_kernels.flash.tiles import MaskConfig
  from pallas_kernels.flash.backward import flash_backward
  from pallas_kernels.flash.config import block_sizes_for
  from pallas_kernels.flash.forward import flash_forward
  sds = jax.ShapeDtypeStruct
  t, hq, hkv = 512, 8, 2
  for d, dtype, segments, mode in ((128, jnp.bfloat16, False, "recompute"),
                                   (96, jnp.float16, True, "atomic"),
                                   (64, jnp.float32, False, "atomic")):
    q = sds((t, hq, d), dtype)
    kv = sds((t, hkv, d), dtype)
    cu = sds((3,), jnp.int32)
    rows = sds((hq, t), jnp.float32)
    seg = sds((t,), jnp.int32) if segments else None
    sink = sds((hq,), jnp.float32)
    cfg = MaskConfig.make(causal=True, window_size=(64, -1),
                          has_segments=segments, softcap=5.0, scale=0.1)
    bf = block_sizes_for(compute_capability=(9, 0), head_dim=d, dtype=dtype,
                         mode="fwd", interpret=False)
    bb = block_sizes_for(compute_capability=(9, 0), head_dim=d, dtype=dtype,
                         mode="bwd" if mode == "recompute" else "bwd_atomic",
                         interpret=False)
    fwd = jax.jit(lambda *a: flash_forward(*a, cfg=cfg, blocks=bf,
                                           max_seqlen_q=256))
    txt = fwd.trace(q, kv, kv, cu, cu, seg, seg, sink).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in txt.lower()
    bwd = jax.jit(lambda *a: flash_backward(
        *a, cfg=cfg, blocks=bb, max_seqlen_q=256, max_seqlen_k=256,
        dq_mode=mode))
    bwd.trace(q, kv, kv, q, rows, q, cu, cu, seg, seg, sink).lower(
        lowering_platforms=("cuda",))


def _use_compiler(monkeypatch, compiler):
  """Kernels traced from now on are compiled by `compiler` ("xla", "triton"
  or "auto"; on the GPU, pip Triton must then really be usable)."""
  monkeypatch.setenv("FOLDAX_KERNEL_COMPILER", compiler)
  if compiler != "xla":
    from pallas_kernels import pip_triton
    assert pip_triton.available() is None, pip_triton.available()


COMPILERS = ("xla", "triton")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("case,dtype", [
    ("gqa4_window", jnp.bfloat16),
    ("sinks_softcap_scale", jnp.bfloat16),
    ("segments", jnp.float32),
    ("causal_sq_gt_sk_masked_rows", jnp.float16),
])
def test_gpu_matches_reference(case, dtype, compiler, monkeypatch):
  _use_compiler(monkeypatch, compiler)
  _check_against_reference(**CASES[case], dtype=dtype, backend="pallas")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("compiler,head_dim", [
    ("xla", 128), ("triton", 128), ("auto", 64)])
def test_gpu_matches_reference_long_gqa(compiler, head_dim, monkeypatch):
  """auto at D64: the shipped table's pip-Triton forward entry (128x64, 8
  warps, 3 stages) with XLA's backward."""
  _use_compiler(monkeypatch, compiler)
  _check_against_reference(b=2, sq=1000, sk=1000, hq=8, hkv=2, d=head_dim,
                           dtype=jnp.bfloat16, causal=True, backend="pallas")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
def test_gpu_pip_triton_lowering_is_taken(monkeypatch):
  """Which kernels lower to jaxlib's Triton call (a pip-Triton cubin) and
  which to XLA's Triton compile: FOLDAX_KERNEL_COMPILER=triton all seven
  (forward, D_i, dK/dV, dQ and the three `_contain` twins), xla none, auto
  the D128 forward and its twin only (the shipped table's pip-Triton entry); every setting gives the same result
  to rounding."""
  rng = np.random.default_rng(3)
  q, do = (_rand(rng, (2, 777, 8, 128), jnp.bfloat16) for _ in range(2))
  k, v = (_rand(rng, (2, 777, 2, 128), jnp.bfloat16) for _ in range(2))
  # Seven kernels: each of forward, dK/dV and dQ has its `_contain` twin
  # (same compiler), and the preprocess.
  expect = {"xla": (0, 7), "triton": (7, 0), "auto": (2, 5)}
  got = {}
  for setting, (n_ffi, n_xla) in expect.items():
    _use_compiler(monkeypatch, setting)
    fn = jax.jit(lambda q, k, v, do: _grads(
        functools.partial(fold_attn_func, causal=True, backend="pallas"),
        q, k, v, do))
    text = fn.lower(q, k, v, do).as_text()
    counts = (text.count("triton_kernel_call_ffi"),
              text.count("__gpu$xla.gpu.triton"))
    assert counts == (n_ffi, n_xla), (setting, counts)
    got[setting] = fn(q, k, v, do)
  for setting in ("triton", "auto"):
    for name, a, b in zip(GRAD_NAMES, got[setting], got["xla"]):
      assert _rel(a, b) < 1e-2, (setting, name)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("mode", ["atomic", "recompute"])
def test_gpu_bitwise_repeatable_and_batch_invariant(mode, compiler,
                                                    monkeypatch):
  """20 identical runs; sequence 2 alone, inside the batch of 4, and packed
  at an offset that is no multiple of any tile between sequences of other
  lengths (plus a tail outside every sequence) gives the same bits."""
  monkeypatch.setenv("FOLDAX_DQ_MODE", mode)
  _use_compiler(monkeypatch, compiler)
  rng = np.random.default_rng(1)
  s = 1024
  q, do = (_rand(rng, (4, s, 8, 128), jnp.bfloat16) for _ in range(2))
  k, v = (_rand(rng, (4, s, 2, 128), jnp.bfloat16) for _ in range(2))
  fn = jax.jit(lambda q, k, v, do: _grads(
      functools.partial(fold_attn_func, causal=True, backend="pallas"),
      q, k, v, do))
  first = fn(q, k, v, do)
  for i in range(19):
    _assert_same_bits(f"[{mode}] B4 run {i + 2} vs run 1", fn(q, k, v, do),
                      first)
  alone = [x[0] for x in fn(q[2:3], k[2:3], v[2:3], do[2:3])]
  _assert_same_bits(f"[{mode}] seq 2 in B4 vs alone (B1)",
                    [x[2] for x in first], alone)
  # Packed: 300 tokens of sequence 0, sequence 2, 517 of sequence 3, then a
  # 29-token tail that belongs to no sequence.
  lens, tail = (300, s, 517), 29
  off = lens[0]
  pack = lambda x: jnp.concatenate(
      [x[0, :lens[0]], x[2], x[3, :lens[2]], x[1, :tail]])
  cu = jnp.asarray(np.cumsum((0,) + lens), jnp.int32)
  packed = _grads(functools.partial(fold_attn_varlen_func, cu_seqlens_q=cu,
                                    max_seqlen_q=s, causal=True,
                                    backend="pallas"),
                  *(pack(x) for x in (q, k, v, do)))
  _assert_same_bits(f"[{mode}] seq 2 packed at offset {off} vs alone",
                    [x[off:off + s] for x in packed], alone)
  tail_bad = [n for n, x in zip(GRAD_NAMES, packed)
              if bool(jnp.any(x[sum(lens):] != 0))]
  assert not tail_bad, f"[{mode}] nonzero rows past cu_seqlens[-1]: {tail_bad}"


def test_block_table_override(tmp_path, monkeypatch):
  """An autotuned table (FOLDAX_BLOCK_TABLE) replaces the shipped entry."""
  import json
  from pallas_kernels.flash.config import BlockSizes, block_sizes_for
  path = tmp_path / "blocks.json"
  path.write_text(json.dumps({json.dumps([9, 128, 2, "fwd"]): dict(
      block_q=64, block_k=32, num_warps=4, num_stages=2)}))
  monkeypatch.setenv("FOLDAX_BLOCK_TABLE", str(path))
  got = block_sizes_for(compute_capability=(9, 0), head_dim=128,
                        dtype=jnp.bfloat16, mode="fwd", interpret=False)
  assert got == BlockSizes(64, 32, 4, 2)
  monkeypatch.delenv("FOLDAX_BLOCK_TABLE")
  assert block_sizes_for(compute_capability=(9, 0), head_dim=128,
                         dtype=jnp.bfloat16, mode="fwd",
                         interpret=False) != got


def test_launch_order_runs_every_program_once():
  """Every (tile, sequence, head) is run by exactly one program, for any
  wave size; within a wave the costliest tile of every head comes first;
  the wave fits L2 when sized automatically."""
  from pallas_kernels.flash import tiles
  for heads, wave, reverse in [(8, 1, True), (8, 2, False), (8, 8, True),
                               (6, 3, False)]:
    order = tiles.launch_order(n_tiles=5, num_seqs=3, heads=heads,
                                heads_per_wave=wave, bytes_per_head=1,
                                reverse=reverse)
    ga, gb, gc = order.grid
    launched = [order.tile_seq_head(a, b, c) for c in range(gc)
                for b in range(gb) for a in range(ga)]  # x fastest
    assert sorted(launched) == [(t, s, h) for t in range(5) for s in range(3)
                                for h in range(heads)]
    costliest = 4 if reverse else 0
    assert [t for t, _, _ in launched[:wave]] == [costliest] * wave
  mb = 1 << 20
  auto = lambda **kw: tiles.launch_order(
      n_tiles=1, num_seqs=1, heads_per_wave=0, reverse=True, **kw)
  assert auto(heads=16, bytes_per_head=4 * mb).heads_per_wave == 4
  assert auto(heads=16, bytes_per_head=4 * mb,
              heads_sharing=4).heads_per_wave == 16
  assert auto(heads=12, bytes_per_head=5 * mb).heads_per_wave == 3
  assert auto(heads=16, bytes_per_head=64 * mb).heads_per_wave == 1
  # A set wave is a cap: the largest divisor of the heads up to it.
  assert tiles.launch_order(n_tiles=1, num_seqs=1, heads=16, heads_per_wave=7,
                             bytes_per_head=1, reverse=True).heads_per_wave == 4
  with pytest.raises(ValueError, match="heads_per_wave"):
    tiles.launch_order(n_tiles=1, num_seqs=1, heads=16, heads_per_wave=-1,
                        bytes_per_head=1, reverse=True)


@pytest.mark.parametrize("mode", ["atomic", "recompute"])
def test_launch_order_keeps_the_bits(mode):
  """The launch order only reorders programs: forward, LSE and gradients
  are bitwise equal for waves of 1, 2 and all 4 heads (GQA, causal,
  packed sequences of different lengths)."""
  from pallas_kernels.flash.tiles import MaskConfig
  from pallas_kernels.flash.backward import flash_backward
  from pallas_kernels.flash.config import BlockSizes
  from pallas_kernels.flash.forward import flash_forward
  rng = np.random.default_rng(5)
  total, hq, hkv, d = 61, 4, 2, 32
  q, do = (_rand(rng, (total, hq, d), jnp.bfloat16) for _ in range(2))
  k, v = (_rand(rng, (total, hkv, d), jnp.bfloat16) for _ in range(2))
  cu = jnp.array([0, 23, 61], jnp.int32)
  cfg = MaskConfig.make(causal=True, window_size=(-1, -1), has_segments=False,
                        softcap=0.0, scale=d ** -0.5)
  results = []
  for wave in (1, 2, 4):
    bs = BlockSizes(16, 16, 4, 1, heads_per_wave=wave,
                    dq=BlockSizes(16, 16, 4, 1, heads_per_wave=wave))
    out, lse2 = flash_forward(q, k, v, cu, cu, cfg=cfg, blocks=bs,
                              max_seqlen_q=38, interpret=True)
    grads = flash_backward(q, k, v, out, lse2, do, cu, cu, cfg=cfg,
                           blocks=bs, max_seqlen_q=38, max_seqlen_k=38,
                           interpret=True, dq_mode=mode)[:3]
    results.append([out, lse2, *grads])
  names = ("out", "lse", "dq", "dk", "dv")
  for wave, got in zip((2, 4), results[1:]):
    _assert_same_bits(f"wave {wave} vs 1", got, results[0], names)
