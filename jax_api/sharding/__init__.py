"""Context parallelism on JAX SPMD: ring attention over a sequence-sharded
mesh axis, bitwise identical across device counts (see `ring`)."""

from jax_api.sharding.mesh import make_mesh, sharded_attention
from jax_api.sharding.ring import default_block_size, ring_attention
from jax_api.sharding.zigzag import unzigzag, zigzag

__all__ = ["ring_attention", "zigzag", "unzigzag", "make_mesh",
           "sharded_attention", "default_block_size"]
