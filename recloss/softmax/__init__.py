"""The softmax cross-entropy objective over the whole catalogue: the log-partition math, the dense
baseline, the blocked pure-JAX sweep, the Pallas kernel and the strategies `dense_ce`, `cutce`,
`cutce_pallas`."""
