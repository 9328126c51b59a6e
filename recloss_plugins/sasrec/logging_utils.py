"""Metric sinks (TensorBoard event files and a JSONL file) and the terminal progress line."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, Optional


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
    torch.utils.tensorboard). ``tensorboard_backend`` says which one (or None)."""

    def __init__(self, run_dir: Path, enable_tensorboard: bool, active: bool = True, log=print):
        self.active = active
        self.tensorboard_backend: Optional[str] = None
        self._tb = None
        self._jsonl = None
        if not active:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = run_dir / "metrics.jsonl"
        self._jsonl = open(self.jsonl_path, "a")
        if enable_tensorboard:
            tb_dir = str(run_dir / "tensorboard")
            try:
                from tensorboardX import SummaryWriter
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
        self._jsonl.write(json.dumps({"step": int(step), "split": prefix, **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(f"{prefix}/{k}", v, int(step))
            self._tb.flush()

    def close(self):
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


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
