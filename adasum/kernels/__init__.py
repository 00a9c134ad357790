"""The compiled extension (``_kernels*.c``) and its Python side, and the segmented device kernels (Triton)."""
