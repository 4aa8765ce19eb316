"""Relaxed integer atomic add for Pallas' Triton lowering.

`jax.experimental.pallas.triton.atomic_add` always lowers with acquire-release
semantics: every element becomes a fenced `atom.acq_rel.gpu`, which serialises
the dQ reduction. Integer addition needs no ordering at all (the sum is the
same in any order, which is the whole point of the integer grid), so this
primitive lowers the same operation with relaxed semantics. It reuses Pallas'
own abstract evaluation and interpret-mode discharge rule, so `interpret=True`
behaves exactly like `atomic_add`.

Private JAX APIs, through `pallas_kernels.compat`.
"""

from __future__ import annotations

from pallas_kernels.compat import jax_core, state, state_discharge
from pallas_kernels.compat import state_indexing as indexing
from pallas_kernels.compat import state_primitives, tree_util, tt_dialect
from pallas_kernels.compat import triton_lowering, triton_primitives

_ADD = triton_primitives.AtomicOpType.ADD

relaxed_atomic_add_p = jax_core.Primitive("fold_relaxed_atomic_add")
relaxed_atomic_add_p.def_effectful_abstract_eval(
    triton_primitives._atomic_abstract_eval)
state_discharge.register_discharge_rule(relaxed_atomic_add_p)(
    triton_primitives._atomic_rmw_discharge_rule)


@triton_lowering.register_lowering(relaxed_atomic_add_p)
def _relaxed_atomic_add_lowering(ctx, *args_flat, args_tree, atomic_type):
  del atomic_type
  block_info, *_ = ctx.block_infos
  ptr, indexers, val, mask = args_tree.unflatten(args_flat)
  *_, value_aval, mask_aval = args_tree.unflatten(ctx.avals_in)
  indexers = list(indexers)
  if not indexers or not isinstance(indexers[-1], indexing.NDIndexer):
    ref_aval = state.transform_type(indexers, ctx.avals_in[0])
    indexers.append(indexing.NDIndexer.make_trivial_indexer(ref_aval.shape))
  (idx,) = indexers
  ptr = triton_lowering._compute_pointers_from_indices(ptr, block_info, idx)
  val = triton_lowering._ensure_ir_value(val, value_aval)
  if mask is not None:
    mask = triton_lowering._ensure_ir_value(mask, mask_aval)
  return triton_lowering._atomic_rmw(
      tt_dialect.RMWOp.ADD, ptr, val, mask=mask,
      semantic=tt_dialect.MemSemantic.RELAXED)


def relaxed_atomic_add(ref, idx, val) -> None:
  """`ref[idx] += val` for int32 values, unordered (red.global.add)."""
  x_ref, transforms = state_primitives.get_ref_and_transforms(
      ref, idx, "relaxed_atomic_add")
  args_flat, args_tree = tree_util.tree_flatten((x_ref, transforms, val, None))
  relaxed_atomic_add_p.bind(*args_flat, args_tree=args_tree, atomic_type=_ADD)
