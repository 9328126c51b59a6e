"""Metric sinks (TensorBoard event files and a JSONL file), the terminal progress line, and what the
trainer logs: the objective's metrics over a log window and the formatted evaluation."""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Dict, List, Optional

from etils import epath



def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class MetricsWriter:
    """Writes scalars to ``run_dir/metrics.jsonl`` and, when available and enabled,
    TensorBoard event files under ``run_dir/tensorboard`` (tensorboardX, else
    torch.utils.tensorboard). ``tensorboard_backend`` says which one (or None).

    ``run_dir`` is an etils.epath.Path, local or ``gs://``. Object storage has no append,
    so metrics.jsonl is kept whole in memory (its earlier lines read back on resume) and
    rewritten as one object on every flush; flushes happen at most every ``flush_secs``
    (Cloud Storage allows about one write per second to one object) and on `close`, so a
    killed process loses at most that many seconds of metrics. TensorBoard events are
    flushed on the same clock (tensorboardX writes gs:// through google-cloud-storage)."""

    def __init__(self, run_dir: epath.Path, enable_tensorboard: bool, active: bool = True, log=print,
                 flush_secs: float = 5.0):
        self.active = active
        self.tensorboard_backend: Optional[str] = None
        self.flush_secs = flush_secs
        self._tb = None
        self._lines: List[str] = []
        self._dirty = False
        self._last_flush = -math.inf
        if not active:
            return
        run_dir = epath.Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = run_dir / "metrics.jsonl"
        if self.jsonl_path.exists():   # a resumed run keeps the lines written before
            self._lines = [l.rstrip("\n") + "\n" for l in self.jsonl_path.read_text().splitlines() if l.strip()]
        if enable_tensorboard:
            tb_dir = str(run_dir / "tensorboard")
            try:
                from tensorboardX import SummaryWriter, record_writer
                record_writer.register_writer_factory("gs", _EpathEventFileFactory())
                self._tb, self.tensorboard_backend = SummaryWriter(tb_dir), "tensorboardX"
            except ImportError:
                try:
                    from torch.utils.tensorboard import SummaryWriter  # type: ignore
                    self._tb, self.tensorboard_backend = SummaryWriter(tb_dir), "torch"
                except ImportError:
                    log("TensorBoard: neither tensorboardX nor torch.utils.tensorboard is installed "
                        f"(pip install tensorboardX); metrics go to {self.jsonl_path} only")

    def write(self, step: int, scalars: Dict[str, float], prefix: str = "train"):
        if not self.active:
            return
        clean = {k: float(v) for k, v in scalars.items()}
        self._lines.append(json.dumps({"step": int(step), "split": prefix, **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(f"{prefix}/{k}", v, int(step))
        self._dirty = True
        if time.monotonic() - self._last_flush >= self.flush_secs:
            self.flush()

    def flush(self):
        """Rewrites metrics.jsonl whole and flushes the TensorBoard events."""
        if not self.active or not self._dirty:
            return
        self.jsonl_path.write_text("".join(self._lines))
        if self._tb is not None:
            self._tb.flush()
        self._dirty = False
        self._last_flush = time.monotonic()

    def close(self):
        if not self.active:
            return
        self.flush()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self.active = False


class _EpathEventFile:
    """An event file on object storage for tensorboardX: records are buffered and the whole
    object is rewritten through etils.epath on flush (no append there), once more on close.

    Replaces tensorboardX's own gs:// writer, which goes through google-cloud-storage with a
    second credential setup and uploads again from ``__del__`` (retrying for minutes when the
    storage has gone away by then)."""

    def __init__(self, path: str):
        self.path = epath.Path(path)
        self.buffer = bytearray()
        self.written = -1

    def write(self, data: bytes):
        self.buffer += data

    def flush(self):
        if len(self.buffer) != self.written:
            self.path.write_bytes(bytes(self.buffer))
            self.written = len(self.buffer)

    def close(self):
        self.flush()


class _EpathEventFileFactory:
    def open(self, path: str) -> _EpathEventFile:
        return _EpathEventFile(path)

    def directory_check(self, path: str):
        epath.Path(path).mkdir(parents=True, exist_ok=True)


class Progress:
    """A single updating line on a terminal (``\\r``), throttled; silent when not a TTY."""

    def __init__(self, total: int, start: int, stream=None, min_interval: float = 0.25):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.start = total, start
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.min_interval = min_interval
        self.extra = ""

    def update(self, done: int, force: bool = False):
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self.last < self.min_interval and done < self.total:
            return
        self.last = now
        rate = (done - self.start) / max(now - self.t0, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        frac = done / max(self.total, 1)
        bar = "#" * int(frac * 24)
        self.stream.write(f"\r[{bar:<24}] {done}/{self.total} {rate:.1f} it/s ETA {format_duration(eta)}"
                          f"{self.extra}\033[K")
        self.stream.flush()

    def clear(self):
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()


# ----------------------------------------------------------------------------- what is logged
def loss_metrics(objective: str, rows) -> Dict[str, float]:
    """The objective's metrics over a log window, from its steps' metrics (``rows``: [(step, dict of floats)]).

    BCE: ``precision`` and ``recall`` at the threshold from the summed tp/fp/fn.
    Softmax: ``top1``, the weighted share of positions whose highest-scoring item
    is one of their targets (Σ top1 / Σ weight_sum), and ``mean_lse``, the
    weighted mean log-partition logsumexp(logits) (what z_loss pulls towards 0).
    A strategy of another objective gets whichever of the two its metrics allow.
    Values are NaN when the metrics are missing or no position had a target.
    """
    first = rows[0][1] if rows else {}
    nan = float("nan")
    if objective == "softmax" or (objective != "bce" and "top1" in first):
        ws = sum(m.get("weight_sum", 0.0) for _, m in rows)
        if "top1" not in first or ws <= 0:
            return {"top1": nan, "mean_lse": nan}
        out = {"top1": sum(m["top1"] for _, m in rows) / ws}
        if "mean_lse" in first:    # a sampled loss has no log-partition: its top1 is among the sampled set
            out["mean_lse"] = sum(m["mean_lse"] * m["weight_sum"] for _, m in rows) / ws
        return out
    if objective == "bce" or "tp" in first:
        if "tp" not in first:
            return {"precision": nan, "recall": nan}
        agg = {k: sum(m[k] for _, m in rows) for k in ("tp", "fp", "fn")}
        prec, rec = precision_recall(agg)
        return {"precision": float(prec), "recall": float(rec)}
    return {}


def precision_recall(metrics, eps: float = 1e-12):
    """Precision and recall at the loss's threshold from the BCE metrics' tp, fp and fn."""
    tp, fp, fn = metrics["tp"], metrics["fp"], metrics["fn"]
    return tp / max(tp + fp, eps), tp / max(tp + fn, eps)


def format_loss_metrics(values: Dict[str, float]) -> str:
    digits = {"precision": ".3f", "recall": ".3f", "top1": ".3f", "mean_lse": ".4g"}
    return " ".join(f"{k} {v:{digits.get(k, '.4g')}}" for k, v in values.items())


def format_eval(res: Dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in res.items() if k != "users")
