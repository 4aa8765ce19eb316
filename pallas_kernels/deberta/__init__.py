"""DeBERTa-v2/v3 disentangled attention: Pallas forward and deterministic
backward over the packed token layout (see `forward` and `backward`)."""

from pallas_kernels.deberta.layout import Geometry, geometry
from pallas_kernels.deberta.backward import disentangled_backward
from pallas_kernels.deberta.config import (DebertaBlocks, KernelConfig,
                                           blocks_for)
from pallas_kernels.deberta.forward import disentangled_forward

__all__ = ["Geometry", "geometry", "KernelConfig", "DebertaBlocks",
           "blocks_for", "disentangled_forward", "disentangled_backward"]
