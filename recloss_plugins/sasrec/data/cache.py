"""recloss-train straight from a log: the log is prepared once into a cache folder keyed by its source.

With ``data_pipeline: grain``, a log (dataset_type interactions or yambda) and ``prepared_data_path``
empty, `prepared_path` picks the folder

    <prepared_cache_dir or base_output_directory/prepared>/<log name>-<key>

where <key> hashes the source files (path, size and modification time, or a gs:// object's
generation) and every config key the preparation reads (`PREPARE_KEYS`). Process 0 prepares the
log there unless a finished preparation with the same key is already there (`KEY_FILE`, written
last, marks it finished); every other process waits for process 0's word through JAX's
coordination service and then reads the same folder, so it must be on storage every host sees
(a gs:// bucket, or a shared mount). An edited log, or another filter or shard count, is another
key and so another folder; nothing is overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Callable, Optional

from recloss_plugins.sasrec.data.shards import FORMAT, MANIFEST, ShardError
from recloss_plugins.sasrec.data.storage import as_path
from recloss_plugins.sasrec.data.tables import data_files

# Every config key `prepare.prepare` (and the readers it streams through) reads, besides the paths.
PREPARE_KEYS = ("dataset_type", "file_format", "user_column", "item_column", "timestamp_column",
                "min_user_interactions", "yambda_event_types", "yambda_organic_only",
                "yambda_min_played_ratio_pct", "num_labels", "prepare_num_shards", "prepare_num_buckets")
KEY_FILE = "cache-key.json"
# How long the other processes wait for process 0's preparation (4.79 B Yambda events take well under this).
WAIT_MS = 24 * 3600 * 1000
_calls = [0]     # every process calls prepared_path equally often: the n-th call's coordination key


def _identity(path) -> dict:
    """What tells a source file's version: size and mtime (local), size and generation (gs://)."""
    text = str(path)
    if text.startswith("gs://"):
        import fsspec
        info = fsspec.filesystem("gs").info(text)
        return {"path": text, "bytes": int(info["size"]),
                "generation": str(info.get("generation") or info.get("updated") or info.get("mtime"))}
    st = os.stat(text)
    return {"path": text, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def cache_key(cfg) -> dict:
    """{'format', 'files', 'keys'}: everything the prepared shards of ``cfg`` depend on."""
    files = data_files(os.fspath(cfg.dataset_path), cfg.file_format)
    keys = {k: (list(cfg[k]) if isinstance(cfg[k], (list, tuple)) else cfg[k]) for k in PREPARE_KEYS}
    return {"format": FORMAT, "files": [_identity(f) for f in files], "keys": keys}


def cache_folder(cfg, key: dict):
    """The folder (an epath.Path) the preparation with ``key`` goes to."""
    root = cfg.prepared_cache_dir or f"{str(cfg.base_output_directory).rstrip('/')}/prepared"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(str(cfg.dataset_path).rstrip("/")) or "log")
    return as_path(root, "prepared_cache_dir" if cfg.prepared_cache_dir else "base_output_directory") \
        / f"{name}-{digest}"


def finished(folder, key: dict) -> bool:
    """Whether ``folder`` holds a finished preparation of ``key``."""
    marker = folder / KEY_FILE
    try:
        return marker.exists() and (folder / MANIFEST).exists() and json.loads(marker.read_text()) == key
    except ValueError:
        return False


def prepared_path(cfg, *, process_index: int = 0, process_count: int = 1, log: Callable = print,
                  progress_stream=None, client=None) -> str:
    """The prepared directory a Grain run of ``cfg`` reads: ``prepared_data_path`` when set, else the
    cache folder of the log, prepared by process 0 when it is not there yet.

    Args:
      process_index, process_count: this process and the job's count.
      log: a print-like function (process 0's lines: which folder, prepared or reused).
      client: JAX's coordination client (`distributed.coordination_client`), needed when
        ``process_count`` > 1: process 0 posts "ok" or its error there, the others wait for it.
    Raises:
      ShardError: another process's preparation failed, or its folder is not visible here.
    """
    if cfg.prepared_data_path:
        return str(cfg.prepared_data_path)
    from recloss_plugins.sasrec.data import prepare

    _calls[0] += 1
    word = f"recloss/prepared/{_calls[0]}"
    if process_count > 1 and client is None:
        raise ShardError("a multi-process run preparing its log needs JAX's coordination client "
                         "(jax.distributed.initialize first), or set prepared_data_path")
    if process_index == 0:
        try:
            key = cache_key(cfg)
            folder = cache_folder(cfg, key)
            if finished(folder, key):
                log(f"data: reusing {folder}, prepared earlier from {cfg.dataset_path} (same files, same keys)")
            else:
                log(f"data: preparing {cfg.dataset_path} once into {folder} (reused by later runs of "
                    "the same log and keys)")
                prepare.prepare(cfg, log=log, progress_stream=progress_stream, output=folder)
                (folder / KEY_FILE).write_text(json.dumps(key, indent=1))
        except Exception as err:
            if process_count > 1:
                client.key_value_set(word, f"error: {type(err).__name__}: {err}")
            raise
        if process_count > 1:
            client.key_value_set(word, f"ok {folder}")
        return str(folder)
    try:
        said = client.blocking_key_value_get(word, WAIT_MS)
    except Exception as err:  # the coordination service's deadline or a lost process 0
        raise ShardError(f"process {process_index} waited for process 0 to prepare {cfg.dataset_path} "
                         f"and got no answer: {err}") from err
    if not said.startswith("ok "):
        raise ShardError(f"process 0 could not prepare {cfg.dataset_path}: {said[len('error: '):]}")
    folder = as_path(said[3:], "prepared_cache_dir")
    if not (folder / KEY_FILE).exists():
        raise ShardError(f"process 0 prepared {cfg.dataset_path} into {str(folder)!r}, which process "
                         f"{process_index} cannot see: set prepared_cache_dir to storage every host shares "
                         "(a gs:// bucket or a shared mount), or prepare first and set prepared_data_path")
    return str(folder)
