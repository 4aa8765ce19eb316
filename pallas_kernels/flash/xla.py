"""Memory-efficient pure-JAX attention: the "xla" backend of the dense op.

For CPU users and as the fallback of every dense/varlen entry point. Follows
the package conventions of `pallas_kernels.reference.dense` exactly (score =
scale * q.k, then softcap * tanh(s / softcap); bottom-right causal; window
(left, right); sinks in the denominator only; lse includes the sink; fully
masked rows give out 0, lse -inf (or the sink) and zero gradients).

Memory: the [seq_q, seq_k] score matrix is never built. Queries are cut into
blocks of up to `chunk_size` rows and keys into chunks of up to `chunk_size`
columns; a `lax.scan` over query blocks runs a `lax.scan` over key chunks with
an online (float32) softmax, so the largest intermediate is
[batch, heads_q, chunk, chunk]. Padded queries/keys get seq_id -1, which
matches nothing. The backward (`backward`, wired as a `jax.custom_vjp` by
`jax_api`, called directly by the torch bridge) recomputes the scores
chunk by chunk from q, k and the saved lse (FlashAttention-2 style) and
accumulates dk/dv across query blocks and dq across key chunks in float32.

GQA/MQA: q is viewed as [batch, seq_q, heads_kv, group, head_dim] (query head
h uses kv head h // group, as `jnp.repeat` does); K/V are never repeated.

Precision: float32 inputs use `Precision.HIGHEST` on every dot; bf16/fp16
inputs feed the dots in their own dtype (P and dS are cast down to it, as
FlashAttention does) with float32 accumulation
(`preferred_element_type=float32`). Softmax statistics are always float32.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from pallas_kernels.reference.dense import MaskSpec, visibility

__all__ = ["XlaConfig", "make_config", "forward", "backward"]

_F32 = jnp.float32


def _pad_axis1(x, n: int, value):
  """Pads axis 1 of `x` up to length `n` with `value`."""
  pad = n - x.shape[1]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _pad_spec(spec: MaskSpec, n: int) -> MaskSpec:
  """Pads a [batch, seq] MaskSpec to [batch, n]; new tokens match nothing."""
  return MaskSpec(_pad_axis1(spec.seq_id, n, -1), _pad_axis1(spec.pos, n, 0),
                  _pad_axis1(spec.length, n, 1))


def _blocks(x, block: int):
  """[batch, n*block, ...] -> [n, batch, block, ...] (scan-major)."""
  b, s = x.shape[:2]
  x = x.reshape((b, s // block, block) + x.shape[2:])
  return jnp.moveaxis(x, 1, 0)


def _unblocks(x):
  """[n, batch, block, ...] -> [batch, n*block, ...]."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _nonfinite_blocks(x):
  """[n] bool: whether block i of x [n, ...] holds a NaN or Inf (once per
  block, not once per pair of the scans)."""
  return jnp.logical_not(jnp.all(jnp.isfinite(x), axis=tuple(
      range(1, x.ndim))))


def _spec_blocks(spec: MaskSpec, block: int) -> MaskSpec:
  return MaskSpec(*(_blocks(jnp.asarray(a, jnp.int32), block) for a in spec))


class XlaConfig:
  """Static, hashable options for one call."""

  def __init__(self, *, causal, window_size, softcap, scale, q_block, k_block,
               compute_dtype):
    self.causal = causal
    self.window_size = window_size
    self.softcap = softcap
    self.scale = scale
    self.q_block = q_block
    self.k_block = k_block
    self.compute_dtype = compute_dtype
    if jnp.dtype(compute_dtype) == jnp.dtype(_F32):
      self.precision = jax.lax.Precision.HIGHEST
    else:
      self.precision = None

  def _key(self):
    return (self.causal, self.window_size, self.softcap, self.scale,
            self.q_block, self.k_block, jnp.dtype(self.compute_dtype).name)

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return isinstance(other, XlaConfig) and self._key() == other._key()

  def dot(self, spec, a, b):
    """einsum with the configured operand dtype, float32 accumulation."""
    a = a.astype(self.compute_dtype)
    b = b.astype(self.compute_dtype)
    return jnp.einsum(spec, a, b, precision=self.precision,
                      preferred_element_type=_F32)

  def scores(self, qb, kc):
    """Scores of a query block and key chunk.

    qb: [b, cq, hkv, g, d]; kc: [b, ck, hkv, d] ->
    (s [b, hkv, g, cq, ck] float32, tanh(raw / softcap) or None).
    """
    s = self.dot("bqhgd,bkhd->bhgqk", qb, kc) * self.scale
    if self.softcap > 0.0:
      t = jnp.tanh(s / self.softcap)
      return self.softcap * t, t
    return s, None

  def visible_dot(self, spec, a, b, vis, b_has_nonfinite):
    """`self.dot(spec, a, b)` where `a` is exactly 0 on the pairs `vis`
    (broadcastable to a) hides; b_has_nonfinite: scalar bool, whether b
    holds a NaN or Inf (`_nonfinite_blocks`, computed once per block).

    A chunk shares one product between visible and hidden pairs (causal
    diagonals, other sequences of a packed batch), and 0 * NaN = NaN: a
    non-finite entry of b would reach every output of the product. Here it
    reaches exactly the outputs with a visible pair on it, as NaN; the
    second product runs only for chunks that hold a non-finite value.
    """
    bad = jnp.logical_not(jnp.isfinite(b))

    def poisoned():
      hits = self.dot(spec, jnp.broadcast_to(vis, a.shape), bad)
      return jnp.where(hits > 0, jnp.nan,
                       self.dot(spec, a, jnp.where(bad, 0, b)))

    return jax.lax.cond(b_has_nonfinite, poisoned,
                        lambda: self.dot(spec, a, b))

  def mask(self, qs: MaskSpec, ks: MaskSpec):
    """[b, 1, 1, cq, ck] visibility of a query block and key chunk."""
    vis = visibility(qs, ks, causal=self.causal, window_size=self.window_size)
    return vis[:, None, None]


# ----------------------------------------------------------------------------
# Forward.
# ----------------------------------------------------------------------------


def forward(cfg: XlaConfig, q, k, v, q_spec, k_spec, sinks):
  """Returns (out [b, sq, hq, d] q.dtype, lse [b, hq, sq] float32)."""
  b, sq, hq, d = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  cq, ck = cfg.q_block, cfg.k_block
  sq_pad = -(-sq // cq) * cq
  sk_pad = -(-sk // ck) * ck

  qx = _pad_axis1(q.reshape(b, sq, hkv, g, d), sq_pad, 0)
  q_blocks = _blocks(qx, cq)  # [nq, b, cq, hkv, g, d]
  qs_blocks = _spec_blocks(_pad_spec(q_spec, sq_pad), cq)
  k_chunks = _blocks(_pad_axis1(k, sk_pad, 0), ck)  # [nk, b, ck, hkv, d]
  v_chunks = _blocks(_pad_axis1(v, sk_pad, 0), ck)
  ks_chunks = _spec_blocks(_pad_spec(k_spec, sk_pad), ck)
  sink = None
  if sinks is not None:
    sink = jnp.asarray(sinks, _F32).reshape(1, hkv, g, 1)

  def q_step(_, xs):
    qb, qs = xs

    def k_step(carry, ys):
      m, l, acc = carry
      kc, vc, ks, v_bad = ys
      s, _ = cfg.scores(qb, kc)
      vis = cfg.mask(qs, ks)
      s = jnp.where(vis, s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp(m - m_safe)  # 0 while m is -inf
      p = jnp.where(vis, jnp.exp(s - m_safe[..., None]), 0.0)
      l = alpha * l + jnp.sum(p, axis=-1)
      acc = alpha[..., None] * acc + cfg.visible_dot("bhgqk,bkhd->bhgqd", p,
                                                     vc, vis, v_bad)
      return (m_new, l, acc), None

    m0 = jnp.full((b, hkv, g, cq), -jnp.inf, _F32)
    l0 = jnp.zeros((b, hkv, g, cq), _F32)
    acc0 = jnp.zeros((b, hkv, g, cq, d), _F32)
    (m, l, acc), _ = jax.lax.scan(
        k_step, (m0, l0, acc0),
        (k_chunks, v_chunks, ks_chunks, _nonfinite_blocks(v_chunks)))
    if sink is not None:
      m_fin = jnp.maximum(m, sink)
      m_safe = jnp.where(m_fin == -jnp.inf, 0.0, m_fin)
      alpha = jnp.exp(m - m_safe)
      l = alpha * l + jnp.exp(sink - m_safe)
      acc = alpha[..., None] * acc
    else:
      m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    ok = l > 0
    safe_l = jnp.where(ok, l, 1.0)
    out = acc / safe_l[..., None]  # 0 on fully masked rows
    lse = jnp.where(ok, m_safe + jnp.log(safe_l), -jnp.inf)
    out = jnp.moveaxis(out, 3, 1).astype(q.dtype)  # [b, cq, hkv, g, d]
    return None, (out, lse)

  _, (out, lse) = jax.lax.scan(q_step, None, (q_blocks, qs_blocks))
  out = _unblocks(out)[:, :sq].reshape(b, sq, hq, d)
  # lse: [nq, b, hkv, g, cq] -> [b, hkv, g, nq, cq] -> [b, hq, sq]
  lse = jnp.moveaxis(lse, 0, 3).reshape(b, hq, sq_pad)[:, :, :sq]
  return out, lse


# ----------------------------------------------------------------------------
# Backward.
# ----------------------------------------------------------------------------


def backward(cfg: XlaConfig, q, k, v, q_spec, k_spec, sinks, out, lse, dout,
              dlse):
  b, sq, hq, d = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  cq, ck = cfg.q_block, cfg.k_block
  sq_pad = -(-sq // cq) * cq
  sk_pad = -(-sk // ck) * ck
  nk = sk_pad // ck

  dout = dout.astype(_F32).reshape(b, sq, hkv, g, d)
  # D_i = dO_i . O_i, then folded with the lse cotangent: dS = P (dP - D').
  delta = jnp.sum(dout * out.astype(_F32).reshape(b, sq, hkv, g, d), -1)
  delta = jnp.moveaxis(delta, 1, -1)  # [b, hkv, g, sq]
  dlse = dlse.astype(_F32).reshape(b, hkv, g, sq)
  delta = delta - dlse
  lse = lse.reshape(b, hkv, g, sq)

  def qblk(x):  # [b, hkv, g, sq] -> [nq, b, hkv, g, cq]
    x = _pad_axis1(jnp.moveaxis(x, 3, 1), sq_pad, 0)  # [b, sq_pad, hkv, g]
    return jnp.moveaxis(_blocks(x, cq), 2, -1)

  lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  q_blocks = _blocks(_pad_axis1(q.reshape(b, sq, hkv, g, d), sq_pad, 0), cq)
  do_blocks = _blocks(_pad_axis1(dout, sq_pad, 0), cq)
  qs_blocks = _spec_blocks(_pad_spec(q_spec, sq_pad), cq)
  k_chunks = _blocks(_pad_axis1(k, sk_pad, 0), ck)
  v_chunks = _blocks(_pad_axis1(v, sk_pad, 0), ck)
  ks_chunks = _spec_blocks(_pad_spec(k_spec, sk_pad), ck)
  k_bad = _nonfinite_blocks(k_chunks)

  def q_step(carry, xs):
    dk_acc, dv_acc = carry  # [nk, b, ck, hkv, d] float32
    qb, dob, qs, lse_b, delta_b, q_bad = xs
    # dO in the layout of P: [b, hkv, g, cq, d]
    do_t = jnp.moveaxis(dob, 1, 3)

    def k_step(dq, ys):
      kc, vc, ks, k_bad = ys
      s, t = cfg.scores(qb, kc)
      vis = cfg.mask(qs, ks)
      p = jnp.where(vis, jnp.exp(s - lse_b[..., None]), 0.0)
      dv_c = cfg.dot("bhgqk,bhgqd->bkhd", p, do_t)
      dp = cfg.dot("bhgqd,bkhd->bhgqk", do_t, vc)
      ds = p * (dp - delta_b[..., None])
      if t is not None:
        ds = ds * (1.0 - t * t)
      # Exact zeros on hidden pairs (dP or D may be non-finite there).
      ds = jnp.where(vis, ds * cfg.scale, 0.0)
      dq = dq + cfg.visible_dot("bhgqk,bkhd->bqhgd", ds, kc, vis, k_bad)
      dk_c = cfg.visible_dot("bhgqk,bqhgd->bkhd", ds, qb, vis, q_bad)
      return dq, (dk_c, dv_c)

    dq0 = jnp.zeros((b, cq, hkv, g, d), _F32)
    dq, (dk_c, dv_c) = jax.lax.scan(k_step, dq0,
                                    (k_chunks, v_chunks, ks_chunks, k_bad))
    return (dk_acc + dk_c, dv_acc + dv_c), dq

  zeros_kv = jnp.zeros((nk, b, ck, hkv, d), _F32)
  (dk, dv), dq = jax.lax.scan(
      q_step, (zeros_kv, zeros_kv),
      (q_blocks, do_blocks, qs_blocks, qblk(lse_safe), qblk(delta),
       _nonfinite_blocks(q_blocks)))
  dq = _unblocks(dq)[:, :sq].reshape(b, sq, hq, d).astype(q.dtype)
  dk = _unblocks(dk)[:, :sk].astype(k.dtype)
  dv = _unblocks(dv)[:, :sk].astype(v.dtype)

  dsinks = None
  if sinks is not None:
    sink = jnp.asarray(sinks, _F32).reshape(1, hkv, g, 1)
    # d lse_i / d sink = exp(sink - lse_i); d out_i / d sink = -that * out_i.
    p_sink = jnp.where(jnp.isfinite(lse), jnp.exp(sink - lse_safe), 0.0)
    dsinks = -jnp.sum(p_sink * delta, axis=(0, 3)).reshape(hq)
    dsinks = dsinks.astype(jnp.asarray(sinks).dtype)
  return dq, dk, dv, dsinks


def make_config(q, k, v, sinks, *, causal: bool, window_size: tuple[int, int],
                softcap: float, softmax_scale: float | None,
                chunk_size: int = 512) -> XlaConfig:
  """Checks shapes and builds the static options of one call.

  q: [batch, seq_q, heads_q, head_dim]; k, v: [batch, seq_k, heads_kv,
  head_dim]; sinks: [heads_q] or None; chunk_size: query-block and key-chunk
  length (clipped to the sequence lengths)."""
  b, sq, hq, d = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  if k.ndim != 4 or v.shape != k.shape or k.shape[0] != b or k.shape[3] != d:
    raise ValueError(f"incompatible q {q.shape}, k {k.shape}, v {v.shape}.")
  if hq % hkv != 0:
    raise ValueError(f"heads_q ({hq}) must be a multiple of heads_kv ({hkv}).")
  if sinks is not None and tuple(jnp.shape(sinks)) != (hq,):
    raise ValueError(f"sinks must have shape ({hq},); got {jnp.shape(sinks)}.")
  chunk_size = int(chunk_size)
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1; got {chunk_size}.")
  left, right = window_size
  scale = (1.0 / d**0.5) if softmax_scale is None else float(softmax_scale)
  return XlaConfig(causal=bool(causal), window_size=(int(left), int(right)),
                   softcap=float(softcap or 0.0), scale=scale,
                   q_block=min(chunk_size, sq), k_block=min(chunk_size, sk),
                   compute_dtype=jnp.result_type(q.dtype, k.dtype, v.dtype))
