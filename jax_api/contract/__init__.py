"""The input contract of every public attention function, framework-neutral.

`jax_api` and `torch_bridge` both call these checks, so the two faces of a
kernel accept and refuse exactly the same inputs with the same messages.
The checks work on what both frameworks can describe without running
anything: shapes (tuples of ints), dtypes (names such as "bfloat16", or numpy
/ JAX dtypes; the torch side maps `torch.float16` to "float16" itself), static
Python values and, where the caller has them on the host, integer values
(numpy arrays). Nothing here imports JAX or torch.

Every error is a `TypeError` (wrong kind of thing) or `ValueError` (right
kind, wrong value) whose message names the argument, what was given and what
is supported.

One module per op:
  `jax_api.contract.common`   arrays, dtypes, scale, soft-cap, window, sinks,
                              backend names
  `jax_api.contract.dense`    q/k/v of dense and varlen attention,
                              cu_seqlens, max_seqlen, segment ids
  `jax_api.contract.kvcache`  cache creation, append, prefill, decode
  `jax_api.contract.deberta`  disentangled-attention options, position tables
"""

from jax_api.contract import common, deberta, dense, kvcache  # noqa: F401
from jax_api.contract.common import (BACKENDS, MAX_HEAD_DIM,
                                     SUPPORTED_DTYPE_NAMES,
                                     SUPPORTED_HEAD_DIMS, dtype_name)

__all__ = ["common", "dense", "kvcache", "deberta", "dtype_name", "BACKENDS",
           "MAX_HEAD_DIM", "SUPPORTED_DTYPE_NAMES", "SUPPORTED_HEAD_DIMS"]
