"""Shared Pallas (Mosaic-TPU) plumbing: the chip table, tile sizes and VMEM budgets (`tiling`), the
vocabulary-sweep grid with its row-chunk loop (`grid`) and the Pallas strategies' options, platform
check and interpret-mode warning (`strategy`). The per-tile math lives with each objective
(`recloss.bce.kernel`, `recloss.softmax.kernel`)."""
