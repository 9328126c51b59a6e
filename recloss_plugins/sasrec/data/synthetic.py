"""A seeded synthetic interaction log: multi-intent sessions with power-law popularity."""

from __future__ import annotations

import numpy as np

from recloss_plugins.sasrec.data.sequences import Sequences


def synthetic(*, num_users: int, num_items: int, min_len: int, max_len: int, num_intents: int,
              intents_per_user: int, zipf_exponent: float, follow_prob: float, switch_prob: float,
              seed: int) -> Sequences:
    """Multi-intent sessions with power-law popularity and sequential structure.

    Items are split into ``num_intents`` clusters; within a cluster item
    popularity follows rank^-zipf_exponent, and cluster popularity
    rank^-zipf_exponent/2. Each item has a fixed successor in its cluster.
    A user mixes ``intents_per_user`` clusters; at each step it switches to
    another of its clusters with ``switch_prob`` (drawing a popular item
    there), else follows the current item's successor with ``follow_prob``,
    else draws a popular item of the current cluster. Lengths are uniform in
    [min_len, max_len]. Everything is a function of ``seed``.
    """
    if num_intents > num_items:
        raise ValueError(f"synthetic_num_intents={num_intents} exceeds synthetic_num_items={num_items}")
    rng = np.random.default_rng([seed, 0x51])
    ids = rng.permutation(num_items).astype(np.int32) + 1
    groups = np.array_split(ids, num_intents)
    width = max(g.size for g in groups)
    members = np.zeros((num_intents, width), np.int32)
    cdf = np.ones((num_intents, width))
    for k, g in enumerate(groups):
        w = (np.arange(1, g.size + 1, dtype=np.float64)) ** -zipf_exponent
        members[k, :g.size] = g
        cdf[k, :g.size] = np.cumsum(w) / w.sum()
        cdf[k, g.size - 1:] = 1.0
    # Row k of the flat CDF spans (k, k+1], so one searchsorted draws from any mix of clusters.
    flat_cdf = (cdf + np.arange(num_intents)[:, None]).ravel()

    def popular(k):
        idx = np.searchsorted(flat_cdf, k + rng.random(k.size), side="right")
        return members.ravel()[np.minimum(idx, k * width + width - 1)]

    intent_of = np.zeros(num_items + 1, np.int64)
    for k, g in enumerate(groups):
        intent_of[g] = k
    sizes = np.array([g.size for g in groups])
    # Successor: a popularity-weighted draw from the item's cluster, never the item itself.
    succ = np.zeros(num_items + 1, np.int32)
    todo = ids[sizes[intent_of[ids]] > 1]
    succ[ids[sizes[intent_of[ids]] == 1]] = ids[sizes[intent_of[ids]] == 1]
    while todo.size:
        cand = popular(intent_of[todo])
        ok = cand != todo
        succ[todo[ok]] = cand[ok]
        todo = todo[~ok]
    iw = np.arange(1, num_intents + 1, dtype=np.float64) ** (-zipf_exponent / 2)
    iw /= iw.sum()
    user_intents = np.stack([rng.choice(num_intents, intents_per_user, replace=False, p=iw)
                             for _ in range(num_users)])
    lengths = rng.integers(min_len, max_len + 1, num_users)

    cur_k = user_intents[np.arange(num_users), rng.integers(0, intents_per_user, num_users)]
    cur = popular(cur_k)
    out = np.zeros((num_users, max_len), np.int32)
    out[:, 0] = cur
    for t in range(1, max_len):
        r = rng.random(num_users)
        switch = r < switch_prob
        follow = (~switch) & (r < switch_prob + (1 - switch_prob) * follow_prob)
        new_k = user_intents[np.arange(num_users), rng.integers(0, intents_per_user, num_users)]
        cur_k = np.where(switch, new_k, cur_k)
        cur = np.where(follow, succ[cur], popular(cur_k))
        out[:, t] = cur
    return Sequences.from_lists([out[u, :lengths[u]] for u in range(num_users)], num_items)
