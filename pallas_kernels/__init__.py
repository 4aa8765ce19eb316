"""Pallas attention kernels (Triton on NVIDIA GPUs, `interpret=True` on CPU)
and their float32 `jnp` references. Knows nothing of autodiff, Flax or torch."""
