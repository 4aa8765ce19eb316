"""Every notebook in notebooks/ runs headless on CPU, cell by cell, without an
error, in small sizes (FOLDAX_NB_SMALL=1; the Pallas kernels in interpret
mode), each within NOTEBOOK_TIMEOUT_S. The kernel is this very interpreter
(sys.executable), whatever `python3` kernelspec a user has installed.

The committed notebooks must be exactly what notebooks/_build.py writes
(outputs cleared): edit the builder, then `python notebooks/_build.py`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NB_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(p.name for p in NB_DIR.glob("*.ipynb"))
NOTEBOOK_TIMEOUT_S = float(os.environ.get("FOLDAX_NB_TIMEOUT_S", 60))  # wall, kernel start included
CELL_TIMEOUT_S = 120         # nbclient's per-cell limit (a hang, not slowness)


class _ThisInterpreter(KernelSpecManager):
  """Resolves every kernel name to an ipykernel on sys.executable, so the
  notebooks see this venv's packages (not a `python3` spec elsewhere)."""

  def get_kernel_spec(self, kernel_name):
    return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f",
                            "{connection_file}"],
                      display_name=f"foldax tests ({sys.executable})",
                      language="python", resource_dir=str(NB_DIR))


def _kernel_env() -> dict:
  env = dict(os.environ)
  env.update(JAX_PLATFORMS="cpu", FOLDAX_NB_SMALL="1", MPLBACKEND="Agg",
             PYTHONPATH=str(REPO) + (os.pathsep + env["PYTHONPATH"]
                                     if env.get("PYTHONPATH") else ""),
             PYDEVD_DISABLE_FILE_VALIDATION="1")
  env.pop("JPY_PARENT_PID", None)
  return env


def test_notebooks_exist():
  assert NOTEBOOKS == ["01_quickstart.ipynb", "02_flax_training.ipynb",
                       "03_pytorch_huggingface.ipynb", "04_serving.ipynb",
                       "05_benchmarks.ipynb"], NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_clean_build_output(name):
  sys.path.insert(0, str(NB_DIR))
  try:
    import _build
  finally:
    sys.path.remove(str(NB_DIR))
  nb = nbformat.read(NB_DIR / name, as_version=4)
  for c in nb.cells:
    if c.cell_type == "code":
      assert c.outputs == [] and c.execution_count is None, (
          f"{name}: outputs not cleared; run python notebooks/_build.py")
  assert nbformat.writes(_build.build(name)) == nbformat.writes(nb), (
      f"{name} differs from notebooks/_build.py; run python notebooks/_build.py")
  src = "".join(c.source for c in nb.cells[:3])
  assert '"google.colab" in sys.modules' in src and "BACKEND" in src


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_on_cpu(name):
  nb = nbformat.read(NB_DIR / name, as_version=4)
  km = KernelManager(kernel_name="python3",
                     kernel_spec_manager=_ThisInterpreter())
  client = nbclient.NotebookClient(
      nb, km=km, timeout=CELL_TIMEOUT_S, kernel_name="python3",
      allow_errors=False, resources={"metadata": {"path": str(NB_DIR)}})
  t0 = time.monotonic()
  try:
    # cleanup_kc: we own this KernelManager, so shut its kernel down too.
    client.execute(env=_kernel_env(), cleanup_kc=True)
  except nbclient.exceptions.CellExecutionError as e:
    pytest.fail(f"{name}: a cell failed:\n{str(e)[-4000:]}")
  finally:
    if km.has_kernel:
      km.shutdown_kernel(now=True)
  elapsed = time.monotonic() - t0
  assert elapsed < NOTEBOOK_TIMEOUT_S, f"{name} took {elapsed:.0f}s"
  assert not km.has_kernel
  # the backend cell reported what runs here
  out = "".join(o.get("text", "") for o in nb.cells[2].outputs
                if o.get("output_type") == "stream")
  assert "BACKEND='interpret'" in out and "small sizes: True" in out, out
  print(f"{name}: {elapsed:.1f}s")
