"""The reference trainer's checkpoints: an Orbax CheckpointManager over ``run_dir/checkpoints``
(local or gs://) holding the train state, a JSON record and, for the Grain pipeline, each process's
iterator state; what a resume checks before it restores (shapes, the PRNG implementation)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Optional

import jax

from recloss_plugins.sasrec import parallel

# The key-data shape of each PRNG implementation, for checkpoints that predate the recorded `prng_impl`.
_KEY_DATA_IMPLS = {(2,): "threefry2x32", (4,): "rbg or unsafe_rbg"}


class Checkpoints:
    """Orbax CheckpointManager over ``run_dir/checkpoints`` (local or gs://): the state pytree, a
    JSON record and, for the Grain pipeline, each process's iterator state (``data``). Every process
    writes its own shards; Orbax keeps the newest ``max_to_keep``."""

    def __init__(self, directory: Path, max_to_keep: int):
        import grain
        import orbax.checkpoint as ocp
        self.ocp, self.grain = ocp, grain
        self.directory = directory
        self.manager = ocp.CheckpointManager(
            directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep or None, create=True),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                           "data": grain.checkpoint.CheckpointHandler()})

    def latest(self) -> Optional[int]:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict, data=None):
        """``data``: a Grain iterator (or `pipeline.frozen_state` of one) whose state is saved too."""
        ocp = self.ocp
        extra = {} if data is None else {"data": self.grain.checkpoint.CheckpointSave(data)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta), **extra))

    def restore(self, step: int, abstract_state, data=None):
        """(state, meta); ``data``, a Grain iterator, is set to the saved state of this process."""
        mismatch = self.shape_mismatch(step, abstract_state)
        if mismatch:
            raise ValueError(mismatch)
        ocp = self.ocp
        extra = {} if data is None else {"data": self.grain.checkpoint.CheckpointRestore(data)}
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore(), **extra))
        return out["state"], out["meta"]

    def data_states(self, step: int) -> Dict[int, dict]:
        """{process index: saved Grain iterator state} of checkpoint ``step`` (one file per process
        of the run that saved it), or {} when it holds no iterator state."""
        found = {}
        folder = self.directory / str(step) / "data"
        if not folder.exists():
            return found
        counts = set()
        for f in folder.iterdir():
            m = re.fullmatch(r"process_(\d+)-of-(\d+)\.json", f.name)
            if m:
                found[int(m.group(1))] = json.loads(f.read_text())
                counts.add(int(m.group(2)))
        if len(counts) > 1 or (counts and sorted(found) != list(range(counts.pop()))):
            raise ValueError(f"checkpoint {step} in {self.directory} holds iterator states "
                             f"{sorted(f.name for f in folder.iterdir())}, not one per process of one run")
        return found

    def meta(self, step: int) -> dict:
        """The JSON record of checkpoint ``step`` alone (no array is read)."""
        ocp = self.ocp
        return dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def prng_impl(self, step: int) -> str:
        """The PRNG implementation of checkpoint ``step``'s keys: its recorded ``prng_impl``, or for a
        checkpoint written before that was recorded, the one its ``rng`` key data's shape implies."""
        try:
            impl = self.meta(step).get("prng_impl")
        except Exception:  # unreadable meta: restore reports what is wrong
            return ""
        if impl:
            return str(impl)
        try:
            shape = tuple(getattr(self.manager.item_metadata(step)["state"]["rng"], "shape", ()))
        except Exception:
            return ""
        return _KEY_DATA_IMPLS.get(shape, f"unknown (key data of shape {shape})")

    def shape_mismatch(self, step: int, abstract_state) -> Optional[str]:
        """The first array whose saved shape differs from ``abstract_state``'s, or None.

        `restore` checks this first: an Orbax restore that fails on one array's shape leaves the
        other arrays' TensorStore reads running on a closed event loop, which dumps "Event loop
        is closed" / "Encountered error while reading array index" tracebacks later."""
        try:
            saved = self.manager.item_metadata(step)["state"]
        except Exception:  # unreadable metadata: restore reports what is wrong
            return None

        def flat(tree):  # "a/b/0" -> leaf; key names only, as Orbax saves lists and namedtuples as dicts
            leaves = jax.tree_util.tree_flatten_with_path(tree)[0] if tree is not None else []
            return {"/".join(map(str, parallel.path_names(path))): leaf for path, leaf in leaves}

        saved = flat(saved)
        for name, want in sorted(flat(abstract_state).items(), key=lambda kv: not kv[0].startswith("params/")):
            have = getattr(saved.get(name), "shape", None)
            if have is not None and tuple(have) != tuple(want.shape):
                return f"{name} has shape {tuple(have)} in the checkpoint but {tuple(want.shape)} in this run"
        return None

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()
