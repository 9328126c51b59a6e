"""Shared Pallas (Mosaic-TPU) plumbing: the chip table, tile sizes and VMEM budgets (`tiling`).
The kernels themselves live with their objective (`recloss.bce.kernel`)."""
