"""The sampled objective: `sampled_softmax` and `gbce`, comparators that draw K negatives per call."""

from recloss.sampled.sampler import log_q_from_counts
from recloss.sampled.strategies import GBCE, SampledSoftmax, SampledStrategy

__all__ = ["GBCE", "SampledSoftmax", "SampledStrategy", "log_q_from_counts"]
