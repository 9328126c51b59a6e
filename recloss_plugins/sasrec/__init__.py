"""The reference multi-label SASRec trainer (`recloss-train`): data splits of the
CutBCE paper, a GPT-2-style causal SASRec in Flax NNX, training with the configured recloss
strategy (`recloss.bce_loss` or `recloss.softmax_loss`), checkpoints, blocked top-K evaluation
and TPU AOT compilation."""
