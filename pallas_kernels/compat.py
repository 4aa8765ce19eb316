"""Every JAX internal (`jax._src`) that `pallas_kernels` touches, in one place.

Checked against jax/jaxlib 0.11.2. `tests/test_compat.py` imports each one and
checks the attributes the kernels use, so a jaxlib that moves or renames one
fails there, loudly, instead of deep inside a kernel build. Nothing else in
the package imports `jax._src`.

Used by: `flash._atomics` (the integer-grid atomic add lowering),
`pip_triton` (compiling Pallas's Triton IR with pip Triton) and `triton_ir`
(capturing that IR).
"""

from __future__ import annotations

from jax._src import core as jax_core  # noqa: F401
from jax._src import state  # noqa: F401
from jax._src import tree_util  # noqa: F401
from jax._src.interpreters import mlir  # noqa: F401
from jax._src.lib.triton import dialect as tt_dialect  # noqa: F401
from jax._src.pallas import core as pallas_core  # noqa: F401
from jax._src.pallas.triton import gpu_info as triton_gpu_info  # noqa: F401
from jax._src.pallas.triton import lowering as triton_lowering  # noqa: F401
from jax._src.pallas.triton import pallas_call_registration as triton_pallas_call  # noqa: F401,E501
from jax._src.pallas.triton import primitives as triton_primitives  # noqa: F401
from jax._src.state import discharge as state_discharge  # noqa: F401
from jax._src.state import indexing as state_indexing  # noqa: F401
from jax._src.state import primitives as state_primitives  # noqa: F401

try:  # jaxlib's Triton call (absent from some CPU-only builds)
  from jax._src.lib import gpu_triton  # noqa: F401
except ImportError as _e:  # pragma: no cover
  gpu_triton = None
  GPU_TRITON_ERROR = f"{type(_e).__name__}: {_e}"
else:
  GPU_TRITON_ERROR = None

CHECKED_WITH = "0.11.2"

# (module attribute of this file, the names of it the package uses).
USED = {
    "jax_core": (),
    "state": (),
    "tree_util": (),
    "mlir": ("sanitize_name",),
    "gpu_triton": ("TritonKernel", "TritonKernelCall",
                   "create_array_parameter"),
    "tt_dialect": (),
    "pallas_core": ("register_lowering_rule",),
    "triton_gpu_info": ("get_gpu_info",),
    "triton_lowering": ("lower_jaxpr_to_triton_module",),
    "triton_pallas_call": ("pallas_call_lowering", "normalize_grid",
                           "gpu_info_lib"),
    "triton_primitives": (),
    "state_discharge": (),
    "state_indexing": (),
    "state_primitives": (),
}
