"""The JAX internals each package reaches through its `compat` module still
exist with the names the package uses (checked with jaxlib 0.11.2): a jaxlib
that moves one fails here, loudly, not deep inside a kernel build."""

import importlib

import jax
import pytest


@pytest.mark.parametrize("package", ["pallas_kernels", "torch_bridge"])
def test_every_internal_the_package_uses_is_there(package):
  if package == "torch_bridge":
    pytest.importorskip("torch")
  compat = importlib.import_module(f"{package}.compat")
  missing = []
  for module_name, names in compat.USED.items():
    module = getattr(compat, module_name)
    if module is None:
      missing.append(f"{module_name} (not importable)")
      continue
    for name in names:
      # jaxlib's Triton call exists only with the CUDA plugin.
      if module_name == "gpu_triton" and not hasattr(module, "TritonKernel"):
        continue
      if not hasattr(module, name):
        missing.append(f"{module_name}.{name}")
  assert not missing, (
      f"{package}.compat was checked with jaxlib {compat.CHECKED_WITH}; "
      f"jaxlib {jax.__version__} lacks {missing}")
