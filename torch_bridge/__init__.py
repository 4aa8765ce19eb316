"""PyTorch bridge to foldax's attention kernels (through DLPack).

    import torch_bridge
    torch_bridge.configure_jax_allocator()   # before JAX starts, see below
    out = torch_bridge.fold_attn_func(q, k, v, causal=True)   # [b, s, h, d]
    out = torch_bridge.fold_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk)
    torch_bridge.hf.register()               # attn_implementation="fold"
    torch_bridge.optimize_deberta(model)     # HF DeBERTa-v2/v3, in place
    cache = torch_bridge.FoldKVCache.create(b, hq, hkv, d, max_len)   # decode
    out = torch_bridge.fold_attn_with_kvcache(q, cache, k_new, v_new)

GPU memory: JAX preallocates 75% of every GPU when its backends start,
underneath torch. Call `torch_bridge.configure_jax_allocator()` before any
JAX computation to make JAX's allocator grow on demand instead (it sets
XLA_PYTHON_CLIENT_PREALLOCATE=false unless an allocator variable is set
already). Importing the package changes nothing; if no allocator variable is
set at the bridge's first call on a CUDA machine, the bridge applies that
default itself before starting JAX and says so once.

Backends: on CUDA GPUs of compute capability 8.0+ (with the CUDA jaxlib) the
Pallas/Triton kernel runs; on the CPU, or a GPU below 8.0 (e.g. a T4), the
bridge runs JAX's XLA path and says so once (logger "torch_bridge").
Float64 inputs (for `torch.autograd.gradcheck`) run the XLA path with
`jax.enable_x64` scoped to the call.

Streams, DLPack and lifetimes: see `torch_bridge._runtime`.
"""

from torch_bridge.settings import configure_jax_allocator
from torch_bridge.attention import (fold_attn_func, fold_attn_varlen_func,
                                    resolve_backend)
from torch_bridge import deberta
from torch_bridge.deberta import disentangled_attention, optimize_deberta
from torch_bridge.kvcache import FoldKVCache, fold_attn_with_kvcache

__all__ = ["fold_attn_func", "fold_attn_varlen_func", "resolve_backend",
           "disentangled_attention", "optimize_deberta", "deberta",
           "FoldKVCache", "fold_attn_with_kvcache", "configure_jax_allocator",
           "hf"]


def __getattr__(name):
  # Submodules that import transformers or other JAX pieces load lazily.
  if name == "hf":
    import importlib
    return importlib.import_module("torch_bridge.hf")
  raise AttributeError(f"module 'torch_bridge' has no attribute {name!r}")
