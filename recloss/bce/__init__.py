"""The multi-label BCE objective (the paper's): (P, Q) math, the dense baseline, the blocked
pure-JAX sweep, the Pallas kernel and the three strategies `dense_bce`, `cutbce`, `cutbce_pallas`."""
