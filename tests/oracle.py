"""Float64 numpy ground truth for `recloss.bce_loss`, `recloss.softmax_loss` (`softmax_oracle`) and
`recloss.sampled_loss` (`sampled_oracle`, at the end), written from the formulas alone.

Nothing here imports recloss: the oracle is an independent reading of
DESIGN.md "The math" and the `LossOptions` docstring.

For hidden rows h_i, table rows e_v and bias b_v the logits are
``x_iv = h_i·e_v + b_v`` (dense [M, R] in float64), or ``c·tanh((h_i·e_v + b_v)/c)`` with
``logit_soft_cap`` c, whose derivative 1 − tanh² multiplies every logit gradient (`soft_cap`). Row i's target set T_i is
its unique ids t with t != pad_id and 0 <= t < V (V = vocab_size or R); every
other non-pad id is invalid and counted once per occurrence. With
y_iv = [v ∈ T_i], the soft label y' = y(1 − ε) + ε/2 and

    P(x) = pos_weight · α · (1 − σ(x))^γ · softplus(−x)
    Q(x) = (1 − α) · σ(x)^γ · softplus(x)          (α-factors are 1 when focal_alpha is None)

the position loss is ``ℓ_i = s_V · Σ_{v < V} [y'·P(x_iv) + (1 − y')·Q(x_iv)]`` with
s_V = 1/V for vocab_reduction='mean' and 1 for 'sum'; table rows ≥ V are inert.

Derivatives (s = σ(x), σ' = s(1 − s), softplus'(±x) = ±σ(±x)):

    P'(x) = −pos_weight·α·(1 − s)^γ · [γ·s·softplus(−x) + (1 − s)]
    Q'(x) =  (1 − α)·s^γ · [γ·(1 − s)·softplus(x) + s]

Reduction with position weights w_i (1 when weights is None):
'mean' L = Σ w·ℓ / Σ w (0 when Σ w = 0), 'sum' L = Σ w·ℓ, 'none' w·ℓ per position.
Gradients are of L, or of Σ_i c_i·w_i·ℓ_i for 'none' with a cotangent c:
G_iv = k_i·s_V·[y'·P' + (1 − y')·Q'] (live columns only), k_i the row's
coefficient; then dhidden = G·E, dtable = Gᵀ·H, dbias = Σ_i G_i.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import numpy as np

# Options the oracle ignores: they change how, not what, is computed.
_SCHEDULE_OPTIONS = ("block_v", "block_n", "compute_metrics", "interpret")


@dataclasses.dataclass
class OracleResult:
    """Float64 ground truth.

    loss: float ('mean'/'sum') or array with hidden's leading shape ('none').
    rows: ℓ_i per position (before weights), hidden's leading shape.
    grads: 'hidden', 'table', 'bias' (None without bias), 'weights' (d L / d w;
      NaN for 'mean' when Σ w = 0, where L is not differentiable).
    loss_scale, grad_scale: the loss and the gradients computed over absolute
      values of the terms an implementation following DESIGN.md adds up: the dense
      background (ε/2)·P + (1 − ε/2)·Q over every live column plus the sparse
      correction (1 − ε)·(P − Q) at the targets, then |G|·|E|, |G|ᵀ·|H|, Σ|G|,
      (|ℓ| + |L|)/Σw. They bound the float32 rounding error of such an
      implementation where the exact result cancels (e.g. a single well-predicted
      target, where background Q and correction −Q nearly cancel).
    metrics: tp, fp, fn, tn (weighted), num_targets, invalid_targets, weight_sum.
    metric_slack: Σ_i |w_i|·#{live v: x_iv within 1e-4·max(1, |x|) of the threshold};
      a float32 implementation may classify those elements either way.
    logits: the float64 logits [M, R].
    dlogits: ∂L/∂logits [M, R] in float64 (BCE), what an implementation multiplies into dA and dE.
    """
    loss: object
    rows: np.ndarray
    grads: Dict[str, Optional[np.ndarray]]
    loss_scale: object
    grad_scale: Dict[str, Optional[np.ndarray]]
    metrics: Dict[str, float]
    metric_slack: float
    logits: np.ndarray
    dlogits: Optional[np.ndarray] = None


def f64(x) -> np.ndarray:
    """Any array (numpy, jax, bfloat16) as float64 numpy."""
    return np.asarray(x).astype(np.float64)

def _inputs(hidden, table, targets, weights, vocab_size, schedule):
    """Float64 [M, D] hidden, [R, D] table, V, int64 [M, L] targets, [M] weights; rejects unknown options."""
    unknown = set(schedule) - set(_SCHEDULE_OPTIONS)
    if unknown:
        raise TypeError(f"oracle got unknown options {sorted(unknown)}")
    h = f64(hidden)
    lead, d = h.shape[:-1], h.shape[-1]
    h2 = h.reshape(-1, d)
    e = f64(table)
    m, r = h2.shape[0], e.shape[0]
    v = r if vocab_size is None else int(vocab_size)
    assert v <= r
    t2 = np.asarray(targets).reshape(m, -1).astype(np.int64)
    w = np.ones(m) if weights is None else f64(weights).reshape(m)
    return lead, d, h2, e, m, r, v, t2, w



def softplus(x):
    return np.logaddexp(0.0, x)


def soft_cap(raw, cap):
    """(c·tanh(raw/c), its derivative 1 − tanh²(raw/c)) in float64; (raw, 1) when cap is None."""
    if cap is None:
        return raw, np.ones_like(raw)
    t = np.tanh(raw / float(cap))
    return float(cap) * t, 1.0 - t * t


def sigmoid_pair(x):
    """(σ(x), 1 − σ(x)) without overflow or cancellation."""
    e = np.exp(-np.abs(x))
    big = 1.0 / (1.0 + e)
    small = e / (1.0 + e)
    return np.where(x >= 0, big, small), np.where(x >= 0, small, big)


def pq_terms(x, *, pos_weight=1.0, focal_gamma=0.0, focal_alpha=None):
    """(P, Q, P', Q') elementwise in float64."""
    s, t = sigmoid_pair(x)
    sp_pos, sp_neg = softplus(x), softplus(-x)
    ap = 1.0 if focal_alpha is None else focal_alpha
    aq = 1.0 if focal_alpha is None else 1.0 - focal_alpha
    g = float(focal_gamma)
    t_pow, s_pow = np.power(t, g), np.power(s, g)      # 0**0 == 1, as γ = 0 requires
    p = pos_weight * ap * t_pow * sp_neg
    q = aq * s_pow * sp_pos
    dp = -pos_weight * ap * t_pow * (g * s * sp_neg + t)
    dq = aq * s_pow * (g * t * sp_pos + s)
    return p, q, dp, dq


def labels_and_invalid(targets, vocab_size: int, rows: int, pad_id: int = -1):
    """Multi-hot labels [M, rows] from targets [M, L] and the invalid-id count."""
    t = np.asarray(targets).astype(np.int64)
    ok = (t != pad_id) & (t >= 0) & (t < vocab_size)
    bad = (t != pad_id) & ~((t >= 0) & (t < vocab_size))
    y = np.zeros((t.shape[0], rows), np.float64)
    r = np.broadcast_to(np.arange(t.shape[0])[:, None], t.shape)
    y[r[ok], t[ok]] = 1.0            # repeats set the same entry: duplicates count once
    return y, int(bad.sum())


def bce_oracle(hidden, table, targets, weights=None, bias=None, *, cotangent=None,
               reduction="mean", vocab_reduction="mean", pad_id=-1, label_smoothing=0.0,
               pos_weight=1.0, focal_gamma=0.0, focal_alpha=None, threshold=0.0,
               vocab_size=None, logit_soft_cap=None, **schedule) -> OracleResult:
    """The loss, its gradients and the metrics in float64 (see the module docstring).

    Args:
      hidden [..., D], table [R, D], targets [..., L] ints, weights [...] or None,
      bias [R] or None; cotangent [...] for reduction='none' (None = ones).
      The keyword options mirror `recloss.LossOptions`; block sizes and other
      schedule-only options are accepted and ignored.
    """
    lead, d, h2, e, m, r, v, t2, w = _inputs(hidden, table, targets, weights, vocab_size, schedule)

    x = h2 @ e.T
    if bias is not None:
        x = x + f64(bias)[None, :]
    x, slope = soft_cap(x, logit_soft_cap)
    live = (np.arange(r) < v)[None, :]
    y, invalid = labels_and_invalid(t2, v, r, pad_id)
    eps = float(label_smoothing)
    ys = y * (1.0 - eps) + eps / 2.0
    p, q, dp, dq = pq_terms(x, pos_weight=pos_weight, focal_gamma=focal_gamma, focal_alpha=focal_alpha)
    dp, dq = dp * slope, dq * slope                  # derivatives in the uncapped logit
    vscale = 1.0 / v if vocab_reduction == "mean" else 1.0
    elem = np.where(live, ys * p + (1.0 - ys) * q, 0.0)
    ell = vscale * elem.sum(axis=1)
    wsum = w.sum()
    # Magnitudes of the background + correction split (see OracleResult).
    bg_v, corr_v = eps / 2 * p + (1 - eps / 2) * q, (1 - eps) * (p - q)
    ell_abs = vscale * np.where(live, np.abs(bg_v) + y * np.abs(corr_v), 0.0).sum(axis=1)
    # The derivative's parts, each in absolute value: P' and Q' are computed apart and added, so a
    # background whose two terms cancel (ε, pos_weight) still carries their rounding.
    dp_abs, dq_abs = np.abs(dp), np.abs(dq)
    g_abs = vscale * np.where(live, eps / 2 * dp_abs + (1 - eps / 2) * dq_abs + y * (1 - eps) * (dp_abs + dq_abs), 0.0)

    if reduction == "mean":
        loss = float((w * ell).sum() / wsum) if wsum != 0 else 0.0
        k = w / wsum if wsum != 0 else np.zeros(m)
        dw = (ell - loss) / wsum if wsum != 0 else np.full(m, np.nan)
        dw_abs = (ell_abs + abs(loss)) / abs(wsum) if wsum != 0 else np.full(m, np.nan)
        loss_abs = float((np.abs(w) * ell_abs).sum() / abs(wsum)) if wsum != 0 else 0.0
    elif reduction == "sum":
        loss = float((w * ell).sum())
        k, dw = w, ell
        dw_abs = ell_abs
        loss_abs = float((np.abs(w) * ell_abs).sum())
    elif reduction == "none":
        c = np.ones(m) if cotangent is None else f64(cotangent).reshape(m)
        loss = (w * ell).reshape(lead)
        k, dw = c * w, c * ell
        dw_abs = np.abs(c) * ell_abs
        loss_abs = (np.abs(w) * ell_abs).reshape(lead)
    else:
        raise ValueError(f"oracle: unknown reduction {reduction!r}")

    g = k[:, None] * vscale * np.where(live, ys * dp + (1.0 - ys) * dq, 0.0)
    grads = {
        "hidden": (g @ e).reshape(lead + (d,)),
        "table": g.T @ h2,
        "bias": None if bias is None else g.sum(axis=0),
        "weights": dw.reshape(lead),
    }
    ga = np.abs(k)[:, None] * g_abs
    grad_scale = {
        "hidden": (ga @ np.abs(e)).reshape(lead + (d,)),
        "table": ga.T @ np.abs(h2),
        "bias": None if bias is None else ga.sum(axis=0),
        "weights": dw_abs.reshape(lead),
    }

    pred = (x > threshold) & live
    pos = y > 0
    neg = ~pos & live
    metrics = {
        "tp": float((w * (pred & pos).sum(1)).sum()),
        "fp": float((w * (pred & neg).sum(1)).sum()),
        "fn": float((w * (~pred & pos).sum(1)).sum()),
        "tn": float((w * (~pred & neg).sum(1)).sum()),
        "num_targets": float(y.sum()),
        "invalid_targets": float(invalid),
        "weight_sum": float(wsum),
    }
    near = (np.abs(x - threshold) <= 1e-4 * np.maximum(1.0, np.abs(x))) & live
    slack = float((np.abs(w) * near.sum(1)).sum())
    return OracleResult(loss, ell.reshape(lead), grads, loss_abs, grad_scale, metrics, slack, x, g)


# ======================================================================== softmax objective
def logsumexp(x, axis=-1):
    top = np.max(x, axis=axis, keepdims=True)
    return np.squeeze(top, axis) + np.log(np.sum(np.exp(x - top), axis=axis))


def softmax_oracle(hidden, table, targets, weights=None, bias=None, *, cotangent=None, reduction="mean",
                   pad_id=-1, label_smoothing=0.0, z_loss=0.0, temperature=1.0, vocab_size=None,
                   logit_soft_cap=None, **schedule) -> OracleResult:
    """Float64 ground truth for `recloss.softmax_loss`, from the formula alone.

    Logits x_iv = cap(h_i·e_v + b_v)/τ over the live columns v < V (rows ≥ V are
    inert; cap = `soft_cap`, the identity without ``logit_soft_cap``); T_i the unique ids t ≠ pad_id in [0, V), k_i = |T_i|;
    Z_i = log Σ_{v<V} exp x_iv, q_iv = (1−ε)·[v ∈ T_i]/k_i + ε/V and

        ℓ_i = Z_i − Σ_v q_iv·x_iv + λ·Z_i²   (0 when k_i = 0),   ∂ℓ_i/∂x_iv = (1 + 2λZ_i)·softmax_v − q_iv.

    Positions with k_i = 0 have weight 0 (also in the mean's Σ w). Reductions and
    cotangents as `bce_oracle`; gradients chain through x = cap(raw)/τ.
    Metrics: num_targets Σk, invalid_targets, weight_sum Σw' (w' = w·[k > 0]),
    top1 Σ w'·[argmax_v x_iv ∈ T_i], mean_lse Σ w'·Z / Σ w'. ``metric_slack`` is
    the weight of rows whose top two logits are within 1e-5·max(1, |x|) (a float32
    argmax may pick either).
    """
    lead, d, h2, e, m, r, v, t2, w = _inputs(hidden, table, targets, weights, vocab_size, schedule)
    tau, eps, lam = float(temperature), float(label_smoothing), float(z_loss)

    raw, slope = soft_cap(h2 @ e.T + (0.0 if bias is None else f64(bias)[None, :]), logit_soft_cap)
    slope = slope[:, :v]
    x = raw[:, :v] / tau
    y, invalid = labels_and_invalid(t2, v, r, pad_id)
    y = y[:, :v]
    k = y.sum(1)
    has = k > 0
    q = (1.0 - eps) * y / np.maximum(k, 1.0)[:, None] + eps / v
    z = logsumexp(x)
    ell = np.where(has, z - (q * x).sum(1) + lam * z * z, 0.0)
    soft = np.exp(x - z[:, None])
    dx = np.where(has[:, None], (1.0 + 2.0 * lam * z)[:, None] * soft - q, 0.0)
    ell_abs = np.where(has, np.abs(z) + (q * np.abs(x)).sum(1) + lam * z * z, 0.0)
    dx_abs = np.where(has[:, None], np.abs(1.0 + 2.0 * lam * z)[:, None] * soft + q, 0.0)

    wp = w * has
    wsum = wp.sum()
    if reduction == "mean":
        loss = float((wp * ell).sum() / wsum) if wsum != 0 else 0.0
        c = wp / wsum if wsum != 0 else np.zeros(m)
        dw = np.where(has, (ell - loss) / wsum, 0.0) if wsum != 0 else np.full(m, np.nan)
        dw_abs = np.where(has, (ell_abs + abs(loss)) / abs(wsum), 0.0) if wsum != 0 else np.full(m, np.nan)
        loss_abs = float((np.abs(wp) * ell_abs).sum() / abs(wsum)) if wsum != 0 else 0.0
    elif reduction == "sum":
        loss = float((wp * ell).sum())
        c, dw, dw_abs = wp, ell, ell_abs
        loss_abs = float((np.abs(wp) * ell_abs).sum())
    elif reduction == "none":
        cot = np.ones(m) if cotangent is None else f64(cotangent).reshape(m)
        loss = (wp * ell).reshape(lead)
        c, dw, dw_abs = cot * wp, cot * ell, np.abs(cot) * ell_abs
        loss_abs = (np.abs(wp) * ell_abs).reshape(lead)
    else:
        raise ValueError(f"oracle: unknown reduction {reduction!r}")

    g = np.zeros((m, r))
    g[:, :v] = c[:, None] * dx * slope / tau
    ga = np.zeros((m, r))
    ga[:, :v] = np.abs(c)[:, None] * dx_abs * slope / tau
    grads = {"hidden": (g @ e).reshape(lead + (d,)), "table": g.T @ h2,
             "bias": None if bias is None else g.sum(axis=0), "weights": dw.reshape(lead)}
    grad_scale = {"hidden": (ga @ np.abs(e)).reshape(lead + (d,)), "table": ga.T @ np.abs(h2),
                  "bias": None if bias is None else ga.sum(axis=0), "weights": dw_abs.reshape(lead)}

    top = np.argmax(x, axis=1)
    hit = y[np.arange(m), top] > 0
    two = np.sort(x, axis=1)[:, -2:] if v > 1 else np.concatenate([x, x - 1.0], axis=1)
    near = (two[:, 1] - two[:, 0]) <= 1e-5 * np.maximum(1.0, np.abs(two[:, 1]))
    metrics = {"num_targets": float(k.sum()), "invalid_targets": float(invalid), "weight_sum": float(wsum),
               "top1": float((wp * hit).sum()),
               "mean_lse": float((wp * z).sum() / wsum) if wsum != 0 else 0.0}
    slack = float((np.abs(wp) * near).sum())
    return OracleResult(loss, ell.reshape(lead), grads, loss_abs, grad_scale, metrics, slack, x)


# ======================================================================== sampled objective
def sampled_oracle(hidden, table, targets, weights=None, bias=None, *, negatives, strategy="sampled_softmax",
                   log_q=None, cotangent=None, reduction="mean", pad_id=-1, temperature=1.0,
                   num_negatives=None, in_batch_negatives=False, remove_accidental_hits=True, gbce_t=0.75,
                   vocab_size=None, **schedule) -> OracleResult:
    """Float64 ground truth for `recloss.sampled_loss` given the drawn ``negatives`` [K] (global ids).

    x_iv = (h_i·e_v + b_v)/τ; T_i, k_i as `softmax_oracle`; q = softmax(log_q) over v < V
    (uniform when None). Candidates of row i: each negative n_j (in order, repeats kept) and,
    with ``in_batch_negatives``, every valid target entry of every row (B entries in all);
    a negative is dead when ``remove_accidental_hits`` and n_j ∈ T_i; an in-batch entry is
    dead when it is in T_i.

    sampled_softmax: s = x − log(K·q) for targets and negatives, x − log(B·q) for in-batch
    entries (log q floored at log(float32 tiny));
        ℓ_i = (1/k_i)·Σ_{t∈T_i} [log(exp s_t + Σ_{c live} exp s_c) − s_t],
        ∂/∂s_t = (p_t − 1)/k_i, ∂/∂s_c = Σ_t p_c^{(t)}/k_i with p^{(t)} the softmax over {t} ∪ live.
    gbce: α = min(1, K/(V − 1)), β = α(t(1 − 1/α) + 1/α);
        ℓ_i = β·Σ_t softplus(−x_t) + Σ_{c live} softplus(x_c),  ∂/∂x_t = −β·σ(−x_t), ∂/∂x_c = σ(x_c).
    Rows with k_i = 0 give 0 and weight 0; reductions and cotangents as `softmax_oracle`.
    Metrics: num_targets, invalid_targets, weight_sum, top1 = Σ w'·[max_t x_t > max_{c live} x_c]
    (``metric_slack``: weight of rows where the two are within 1e-5·max(1, |x|)).
    """
    lead, d, h2, e, m, r, v, t2, w = _inputs(hidden, table, targets, weights, vocab_size, schedule)
    tau = float(temperature)
    neg = np.asarray(negatives).astype(np.int64).reshape(-1)
    kneg = len(neg)
    assert num_negatives is None or num_negatives == kneg
    assert np.all((neg >= 0) & (neg < v))
    if log_q is None:
        lq = np.full(v, -np.log(v))
    else:
        raw_q = f64(log_q)[:v]
        lq = raw_q - logsumexp(raw_q[None, :])[0]
    lq_floor = np.maximum(lq, np.log(np.finfo(np.float32).tiny))

    x = (h2 @ e.T + (0.0 if bias is None else f64(bias)[None, :])) / tau      # [M, R]
    y, invalid = labels_and_invalid(t2, v, r, pad_id)
    sets = [sorted(set(int(i) for i in row if i != pad_id and 0 <= i < v)) for row in t2]
    batch = [i for s in sets for i in s]                                        # in-batch entries
    nb = len(batch)
    alpha = 1.0 if v <= 1 else min(1.0, kneg / (v - 1))
    beta = alpha * (gbce_t * (1.0 - 1.0 / alpha) + 1.0 / alpha)

    ell = np.zeros(m)
    dx = np.zeros((m, r))                                # ∂ℓ_i/∂x_iv (x after τ)
    hit = np.zeros(m, bool)
    near = np.zeros(m, bool)
    for i in range(m):
        T = sets[i]
        if not T:
            continue
        cand, corr = [], []
        for n in neg:
            if remove_accidental_hits and n in T:
                continue
            cand.append(int(n))
            corr.append(np.log(kneg) + lq_floor[n])
        if in_batch_negatives:
            for c in batch:
                if c in T:
                    continue
                cand.append(c)
                corr.append(np.log(nb) + lq_floor[c])
        cand = np.asarray(cand, np.int64)
        corr = np.asarray(corr)
        xc = x[i, cand]
        if strategy == "sampled_softmax":
            sc = xc - corr
            for t in T:
                st = x[i, t] - (np.log(kneg) + lq_floor[t])
                allv = np.concatenate([[st], sc])
                z = logsumexp(allv[None, :])[0]
                ell[i] += (z - st) / len(T)
                p = np.exp(allv - z)
                dx[i, t] += (p[0] - 1.0) / len(T)
                np.add.at(dx[i], cand, p[1:] / len(T))
        elif strategy == "gbce":
            xt = x[i, T]
            ell[i] = beta * softplus(-xt).sum() + softplus(xc).sum()
            dx[i, T] += -beta * sigmoid_pair(xt)[1]
            np.add.at(dx[i], cand, sigmoid_pair(xc)[0])
        else:
            raise ValueError(f"oracle: unknown sampled strategy {strategy!r}")
        best = x[i, T].max()
        rival = xc.max() if len(cand) else -np.inf
        hit[i] = best > rival
        near[i] = np.isfinite(rival) and abs(best - rival) <= 1e-5 * max(1.0, abs(best))

    has = np.array([len(s) > 0 for s in sets])
    wp = w * has
    wsum = wp.sum()
    ell_abs = np.abs(ell)
    if reduction == "mean":
        loss = float((wp * ell).sum() / wsum) if wsum != 0 else 0.0
        c = wp / wsum if wsum != 0 else np.zeros(m)
        dw = np.where(has, (ell - loss) / wsum, 0.0) if wsum != 0 else np.full(m, np.nan)
        dw_abs = np.where(has, (ell_abs + abs(loss)) / abs(wsum), 0.0) if wsum != 0 else np.full(m, np.nan)
        loss_abs = float((np.abs(wp) * ell_abs).sum() / abs(wsum)) if wsum != 0 else 0.0
    elif reduction == "sum":
        loss = float((wp * ell).sum())
        c, dw, dw_abs = wp, ell, ell_abs
        loss_abs = float((np.abs(wp) * ell_abs).sum())
    elif reduction == "none":
        cot = np.ones(m) if cotangent is None else f64(cotangent).reshape(m)
        loss = (wp * ell).reshape(lead)
        c, dw, dw_abs = cot * wp, cot * ell, np.abs(cot) * ell_abs
        loss_abs = (np.abs(wp) * ell_abs).reshape(lead)
    else:
        raise ValueError(f"oracle: unknown reduction {reduction!r}")

    g = c[:, None] * dx / tau
    ga = np.abs(c)[:, None] * np.abs(dx) / tau
    grads = {"hidden": (g @ e).reshape(lead + (d,)), "table": g.T @ h2,
             "bias": None if bias is None else g.sum(axis=0), "weights": dw.reshape(lead)}
    grad_scale = {"hidden": (ga @ np.abs(e)).reshape(lead + (d,)), "table": ga.T @ np.abs(h2),
                  "bias": None if bias is None else ga.sum(axis=0), "weights": dw_abs.reshape(lead)}
    metrics = {"num_targets": float(y[:, :v].sum()), "invalid_targets": float(invalid),
               "weight_sum": float(wsum), "top1": float((wp * hit).sum())}
    slack = float((np.abs(wp) * near).sum())
    return OracleResult(loss, ell.reshape(lead), grads, loss_abs, grad_scale, metrics, slack, x)
