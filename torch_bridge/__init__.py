"""PyTorch bridge to the same kernels (through DLPack); see issue 7."""
