"""The decode op's framework-neutral core (`pallas_kernels.decode.core`) as
`jax_api.kvcache` calls it: the same bits through `fold_attn_with_kvcache`
and through `core.decode` over `FoldKVCache.paged_kv`, `DecodeOptions`
refusing an unresolved backend, `config=` (a KernelSettings) active while
the decode and prefill kernels are planned, and `clear_error`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_api import KernelSettings
from jax_api import _kvcache_write
from jax_api.kvcache import ERR_MAX_LEN, FoldKVCache, fold_attn_with_kvcache
from pallas_kernels import settings
from pallas_kernels.decode import core, ops

S = 16


def _rand(rng, shape, dtype=jnp.bfloat16):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


def _filled(rng, lens=(20, 37), hq=4, hkv=2, d=16, **create):
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  t = int(cu[-1])
  cache = FoldKVCache.create(len(lens), hq, hkv, d, 64, page_size=S,
                             chunk_tokens=2 * S, **create)
  q, k, v = (_rand(rng, (t, h, d)) for h in (hq, hkv, hkv))
  _, cache = cache.prefill(q, k, v, cu, backend="xla")
  return cache


def _bits(x):
  return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))


@pytest.mark.parametrize("kv_dtype", [None, jnp.float8_e4m3fn])
def test_core_decode_is_what_the_cache_calls(kv_dtype):
  rng = np.random.default_rng(0)
  cache = _filled(rng, kv_dtype=kv_dtype)
  q = _rand(rng, (2, 4, 16))
  sinks = _rand(rng, (4,), jnp.float32)
  for backend in ("xla", "interpret"):
    out, _ = fold_attn_with_kvcache(q, cache, sinks=sinks, softcap=5.0,
                                    window_size=(24, 0), backend=backend)
    opts = core.DecodeOptions(backend=backend, chunk_tokens=2 * S,
                              softmax_scale=0.25, window_left=24,
                              softcap=5.0)
    direct = core.decode(q, cache.paged_kv, sinks, options=opts)
    np.testing.assert_array_equal(_bits(direct), _bits(out))
    assert isinstance(cache.paged_kv, core.PagedKV)


def test_decode_options_need_a_resolved_backend():
  with pytest.raises(ValueError, match="backend"):
    core.DecodeOptions(backend="auto", chunk_tokens=256)


def test_config_is_active_while_the_kernels_are_planned(monkeypatch):
  rng = np.random.default_rng(1)
  cache = _filled(rng)
  q = _rand(rng, (2, 4, 16))
  seen = []
  real = ops.decode_blocks_for

  def spy(**kw):
    seen.append(settings.current())
    return real(**kw)

  monkeypatch.setattr(ops, "decode_blocks_for", spy)
  cfg = KernelSettings(decode_blocks=(32, 4, 2))
  fold_attn_with_kvcache(q, cache, backend="interpret", config=cfg)
  cache.attend(q, backend="interpret", config=cfg)
  fold_attn_with_kvcache(q, cache, backend="interpret")
  assert seen[:2] == [cfg, cfg] and seen[2] == settings.from_environment()
  with pytest.raises(TypeError, match="KernelSettings"):
    fold_attn_with_kvcache(q, cache, backend="interpret", config="fast")

  # prefill hands its config to the dense kernel (a static argument).
  got = []
  real_varlen = _kvcache_write.fold_attn_varlen_func

  def varlen_spy(*a, config=None, **kw):
    got.append(config)
    return real_varlen(*a, config=config, **kw)

  monkeypatch.setattr(_kvcache_write, "fold_attn_varlen_func", varlen_spy)
  empty = FoldKVCache.create(1, 4, 2, 16, 64, page_size=S)
  cu = jnp.asarray([0, 9], jnp.int32)
  pcfg = KernelSettings(dq_mode="atomic")
  empty.prefill(_rand(rng, (9, 4, 16)), _rand(rng, (9, 2, 16)),
                _rand(rng, (9, 2, 16)), cu, backend="xla", config=pcfg)
  assert got == [pcfg]


def test_clear_error_resets_only_the_error_word():
  rng = np.random.default_rng(2)
  cache = _filled(rng)
  k = _rand(rng, (2, 30, 2, 16))
  over = jax.jit(lambda c, k: c.append(k, k))(cache, k)
  assert int(over.error) & ERR_MAX_LEN
  with pytest.raises(ValueError, match="refused"):
    over.check()
  cleared = over.clear_error()
  assert int(cleared.error) == 0 and cleared.check() is cleared
  for a, b in zip(jax.tree_util.tree_leaves(cleared.paged_kv),
                  jax.tree_util.tree_leaves(cache.paged_kv)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
