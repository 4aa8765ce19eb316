"""PyTorch bridge to foldax's attention kernels (through DLPack).

    import torch_bridge                      # before JAX starts, see below
    out = torch_bridge.fold_attn_func(q, k, v, causal=True)   # [b, s, h, d]
    out = torch_bridge.fold_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk)
    torch_bridge.hf.register()               # attn_implementation="fold"
    torch_bridge.optimize_deberta(model)     # HF DeBERTa-v2/v3, in place
    cache = torch_bridge.FoldKVCache.create(b, hq, hkv, d, max_len)   # decode
    out = torch_bridge.fold_attn_with_kvcache(q, cache, k_new, v_new)

GPU memory: importing this package sets XLA_PYTHON_CLIENT_PREALLOCATE=false
(unless XLA_PYTHON_CLIENT_PREALLOCATE, XLA_PYTHON_CLIENT_MEM_FRACTION or
XLA_PYTHON_CLIENT_ALLOCATOR is already set) so that JAX does not take 75% of
the GPU underneath torch when its backend starts; it must therefore be
imported before JAX initialises its backends (before any JAX computation). If
JAX was already initialised, the bridge warns once on GPU machines.

Backends: on CUDA GPUs of compute capability 8.0+ (with the CUDA jaxlib) the
Pallas/Triton kernel runs; on the CPU, or a GPU below 8.0 (e.g. a T4), the
bridge runs JAX's XLA path and says so once (logger "torch_bridge").
Float64 inputs (for `torch.autograd.gradcheck`) run the XLA path with
`jax.enable_x64` scoped to the call.

Streams, DLPack and lifetimes: see `torch_bridge._runtime`.
"""

from torch_bridge import _runtime, settings

_SET_ALLOCATOR = settings.configure_jax_allocator()
_runtime.warn_if_jax_initialised_early(_SET_ALLOCATOR)

from torch_bridge.attention import (fold_attn_func,  # noqa: E402
                                    fold_attn_varlen_func, resolve_backend)
from torch_bridge import deberta  # noqa: E402
from torch_bridge.deberta import (disentangled_attention,  # noqa: E402
                                  optimize_deberta)
from torch_bridge.kvcache import (FoldKVCache,  # noqa: E402
                                  fold_attn_with_kvcache)

__all__ = ["fold_attn_func", "fold_attn_varlen_func", "resolve_backend",
           "disentangled_attention", "optimize_deberta", "deberta",
           "FoldKVCache", "fold_attn_with_kvcache", "hf"]


def __getattr__(name):
  # Submodules that import transformers or other JAX pieces load lazily.
  if name == "hf":
    import importlib
    return importlib.import_module("torch_bridge.hf")
  raise AttributeError(f"module 'torch_bridge' has no attribute {name!r}")
