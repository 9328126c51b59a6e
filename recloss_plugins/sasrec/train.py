"""recloss-train: the reference multi-label SASRec trainer.

    recloss-train configs/base.yml loss=cutbce_pallas steps=100 run_name=demo

Loads and validates the config, builds the paper's splits (Section III-E),
trains SASRec with the configured strategy (``loss:``; a BCE one computes
`recloss.bce_loss`, a softmax one `recloss.softmax_loss`) on a device mesh,
logs loss / throughput and the objective's metrics (BCE: precision/recall of
the cut metrics; softmax: top-1 rate and mean log-partition), checkpoints with Orbax (re-running
the same run_name resumes from the latest checkpoint), and ends with dev/test
Hit@K, Recall@K, NDCG@K next to a most-popular baseline. With
``compile_topology`` set it compiles the train step for that TPU topology
instead and prints per-chip HBM (see `aot`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Dict, Optional

import jax
import numpy as np

from recloss import metrics as metrics_lib
from recloss_plugins.config import ConfigError, dump_config, load_config
from recloss_plugins.sasrec import data as data_lib
from recloss_plugins.sasrec import distributed
from recloss_plugins.sasrec import eval as eval_lib
from recloss_plugins.sasrec import parallel
from recloss_plugins.sasrec.data import pipeline as pipeline_lib
from recloss_plugins.sasrec.logging_utils import MetricsWriter, Progress, format_duration
from recloss_plugins.sasrec.program import Program, format_memory, memory_report, program_for

# The key-data shape of each PRNG implementation, for checkpoints that predate the recorded `prng_impl`.
_KEY_DATA_IMPLS = {(2,): "threefry2x32", (4,): "rbg or unsafe_rbg"}

USAGE = """usage: recloss-train [CONFIG.yml] [key=value ...]

Trains the multi-label SASRec reference model. CONFIG defaults to configs/base.yml,
which lists every key with a comment. Examples:
  recloss-train configs/base.yml loss=cutbce_pallas steps=100
  recloss-train configs/base.yml loss=cutce z_loss=1e-4 steps=100
  recloss-train configs/sasrec_yambda.yml compile_topology=v6e-8 loss=dense_bce
"""


class NonFiniteLossError(RuntimeError):
    """Training produced a non-finite loss or gradient; the run stopped without saving."""


@dataclasses.dataclass
class TrainResult:
    run_dir: Path
    steps_done: int
    data_position: int
    losses: Dict[int, float]          # step index (0-based) -> loss, for every step this run took
    evals: Dict[str, Dict[str, float]]  # 'dev', 'test', 'dev_popularity', 'test_popularity'
    state: Optional[dict] = None      # final state (global arrays)
    program: Optional[Program] = None


def _scalar(x) -> float:
    """A replicated scalar's value on this process (works multi-process too)."""
    return float(np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else x)


def _run_dir(cfg) -> Path:
    """base_output_directory/run_name as an etils.epath.Path (local or gs://, `data.as_path`)."""
    name = cfg.run_name
    if not name:
        if jax.process_count() > 1:
            raise ConfigError("config key 'run_name' must be set for a multi-process run "
                              "(every process must agree on the run directory)")
        name = time.strftime("sasrec_%Y%m%d_%H%M%S")
    return data_lib.as_path(cfg.base_output_directory, "base_output_directory") / name


# ----------------------------------------------------------------------------- logged loss metrics
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
        prec, rec = metrics_lib.precision_recall(agg)
        return {"precision": float(prec), "recall": float(rec)}
    return {}


def _fmt_loss_metrics(values: Dict[str, float]) -> str:
    digits = {"precision": ".3f", "recall": ".3f", "top1": ".3f", "mean_lse": ".4g"}
    return " ".join(f"{k} {v:{digits.get(k, '.4g')}}" for k, v in values.items())


# ----------------------------------------------------------------------------- evaluation
def _evaluate(program: Program, params, ds, name: str, **kw) -> Dict[str, Dict[str, float]]:
    """`eval.evaluate` of split ``name``: for Grain data each process holds and scores its own users;
    an in-memory Dataset holds every user on every process, each scoring its share."""
    if isinstance(ds, pipeline_lib.GrainData):
        return eval_lib.evaluate(program, params, ds.eval_split(name), **kw)
    return eval_lib.evaluate(program, params, getattr(ds, name), replicated=True, **kw)


# ----------------------------------------------------------------------------- checkpoints
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
            return {"/".join(str(next((getattr(k, a) for a in ("key", "idx", "name") if hasattr(k, a)), k))
                             for k in path): leaf for path, leaf in leaves}

        saved = flat(saved)
        for name, want in sorted(flat(abstract_state).items(), key=lambda kv: not kv[0].startswith("params/")):
            have = getattr(saved.get(name), "shape", None)
            if have is not None and tuple(have) != tuple(want.shape):
                return f"{name} has shape {tuple(have)} in the checkpoint but {tuple(want.shape)} in this run"
        return None

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


# ----------------------------------------------------------------------------- training
def train(cfg, *, devices=None, dataset: Optional[data_lib.Dataset] = None, stop_after: Optional[int] = None,
          log=print, progress_stream=None) -> TrainResult:
    """Trains (or resumes) the run ``cfg`` describes and evaluates it.

    Args:
      cfg: a config from `load_config`.
      devices: devices of the mesh (default: all).
      dataset: prebuilt data (default: built from cfg).
      stop_after: stop once this many steps are done in total, as if preempted
        (checkpoints are written only at their usual period); for tests.
      log: a print-like function for log lines (only process 0 logs).
    Raises:
      NonFiniteLossError: a step's loss or gradient norm was not finite.
    """
    is_main = jax.process_index() == 0
    say = log if is_main else (lambda *a, **k: None)
    devices = list(jax.devices() if devices is None else devices)
    mesh = parallel.build_mesh(cfg, devices)
    run_dir = _run_dir(cfg)  # before any work: a bad gs:// URL, missing credentials or bucket fail here
    if is_main:
        data_lib.make_dir(run_dir, "base_output_directory")

    t0 = time.perf_counter()
    if dataset is not None:
        ds = dataset
    elif pipeline_lib.uses_grain(cfg):
        ds = pipeline_lib.grain_data_for(cfg, jax.process_index(), jax.process_count())
    else:
        ds = data_lib.build_dataset(cfg)
    vocab = ds.vocab_size
    if cfg.vocab_size:
        if cfg.vocab_size < vocab:
            raise ConfigError(f"config key 'vocab_size' is {cfg.vocab_size}, but the data has "
                              f"{vocab - 1} items (+1 padding = {vocab}); set vocab_size: 0 or >= {vocab}")
        vocab = cfg.vocab_size
    if isinstance(ds, pipeline_lib.GrainData):
        c = ds.counts()
        say(f"data: {cfg.dataset_type} via grain, {c['users']} users, {c['interactions']} interactions, "
            f"{c['items']} items (V={vocab} with padding); {ds.manifest.num_shards} shards in "
            f"{ds.manifest.path}, process {ds.process_index} of {ds.process_count} reads shards "
            f"{ds.shard_ids[0]}..{ds.shard_ids[-1]} ({c['local_train_users']} train users) "
            f"({time.perf_counter() - t0:.1f}s)")
    else:
        say(f"data: {cfg.dataset_type}, {ds.sequences.num_users} users, {ds.sequences.items.size} interactions, "
            f"{ds.sequences.num_items} items (V={vocab} with padding); split users train {ds.train.num_users} "
            f"dev {ds.dev.num_users} test {ds.test.num_users} ({time.perf_counter() - t0:.1f}s)")

    program = program_for(cfg, mesh, vocab, item_counts=ds.popularity)   # counts: a sampled loss's logQ
    B = program.batch_size
    if isinstance(ds, pipeline_lib.GrainData):
        ds.local_batch_size(B)  # B must split over the shards: a named error before any work
    say(f"mesh: {dict(mesh.shape)} over {len(devices)} {program.layout.platform} device(s); "
        f"loss={cfg.loss}; table rows {program.rows} (V={vocab}); global batch {B}")

    writer = MetricsWriter(run_dir, cfg.enable_tensorboard, active=is_main, log=say)
    ckpt = Checkpoints(run_dir / "checkpoints", cfg.max_checkpoints_to_keep) if cfg.enable_checkpointing else None

    try:
        return _train_body(cfg, ds, program, vocab, run_dir, writer, ckpt, stop_after=stop_after, say=say,
                           is_main=is_main, progress_stream=progress_stream)
    finally:
        if ckpt is not None:
            ckpt.close()
        writer.close()


def _train_body(cfg, ds, program, vocab, run_dir, writer, ckpt, *, stop_after, say, is_main, progress_stream):
    B = program.batch_size
    grain_it = None
    if isinstance(ds, pipeline_lib.GrainData):  # this process's rows of each global batch, from its shards
        grain_it = ds.train_iterator(B, cfg.seed, read_threads=cfg.grain_read_threads,
                                     prefetch=cfg.grain_prefetch_buffer)
    # ---- state: resume or init
    state, position, start = None, 0, 0
    if ckpt is not None and ckpt.latest() is not None:
        latest = ckpt.latest()
        old_cfg = run_dir / "config.yml"
        if old_cfg.exists():
            _report_config_changes(old_cfg, cfg, say)
        saved_impl = ckpt.prng_impl(latest)
        if saved_impl and saved_impl != program.prng_impl:
            raise ConfigError(
                f"cannot resume {run_dir} from step {latest}: its checkpoint holds {saved_impl} PRNG keys, but "
                f"this trainer draws {program.prng_impl} keys (pinned, whatever jax_default_prng_impl says); "
                f"resuming would change the dropout and negatives streams mid-run. Use a new run_name")
        try:
            state, meta = ckpt.restore(latest, program.abstract_state, data=grain_it)
        except Exception as err:  # shape/structure mismatch: a different model in this run_name
            raise ConfigError(f"cannot resume {run_dir} from step {latest}: {err}. The checkpoint was "
                              "written by a different model/vocabulary; use a new run_name") from err
        if meta.get("vocab_size") != vocab or meta.get("table_rows") != program.rows:
            raise ConfigError(f"cannot resume {run_dir}: its checkpoint has V={meta.get('vocab_size')}, "
                              f"{meta.get('table_rows')} rows; this run has V={vocab}, {program.rows} rows")
        position, start = int(meta["data_position"]), int(meta["step"])
        say(f"resumed from {ckpt.directory} step {start} (data position {position})")
    else:
        state = program.init()
    if is_main:
        (run_dir / "config.yml").write_text(dump_config(cfg))

    compiled = program.compiled_train_step()
    say(f"compiled train step, per-device memory: {format_memory(memory_report(compiled))}")

    batches = data_lib.TrainBatches(ds.train, B, cfg.seed) if grain_it is None else None
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    losses: Dict[int, float] = {}
    pending = []            # (step index, metrics) not yet fetched to the host
    window = {"t": time.perf_counter(), "step": start}
    progress = Progress(cfg.steps, start, progress_stream)
    last_saved = ckpt.latest() if ckpt is not None else None

    def fetch():
        """Moves pending metrics to the host; raises on the first non-finite step."""
        rows = [(s, {k: _scalar(v) for k, v in m.items()}) for s, m in pending]
        pending.clear()
        for s, m in rows:
            if not m["finite"]:
                progress.clear()
                where = (f"the last good checkpoint is step {last_saved} in {ckpt.directory} (left intact)"
                         if last_saved is not None else "no checkpoint was written")
                raise NonFiniteLossError(
                    f"non-finite loss {m['loss']} (grad norm {m['grad_norm']}) at step {s + 1}; stopping. "
                    f"{where}. Lower learning_rate, enable grad_clip, or use dtype=float32.")
            losses[s] = m["loss"]
        return rows

    def log_window(done: int, rows):
        if not rows:
            return
        now = time.perf_counter()
        dt = max(now - window["t"], 1e-9)
        steps_n = done - window["step"]
        loss = float(np.mean([m["loss"] for _, m in rows]))
        objective_metrics = loss_metrics(program.strategy.objective, rows)
        sps = steps_n / dt
        ips = sum(m.get("weight_sum", 0.0) for _, m in rows) / dt
        eta = (cfg.steps - done) / sps if sps > 0 else float("inf")
        last = rows[-1][1]
        progress.clear()
        shown = f" | {_fmt_loss_metrics(objective_metrics)}" if objective_metrics else ""
        say(f"step {done}/{cfg.steps} | loss {loss:.6g}{shown} | "
            f"grad_norm {last['grad_norm']:.3g} | lr {last['learning_rate']:.3g} | {sps:.2f} steps/s | "
            f"{ips:,.0f} items/s | ETA {format_duration(eta)}")
        writer.write(done, {"loss": loss, **objective_metrics, "grad_norm": last["grad_norm"],
                            "learning_rate": last["learning_rate"], "steps_per_sec": sps, "items_per_sec": ips})
        window.update(t=now, step=done)

    rows_since_log = []
    evals: Dict[str, Dict[str, float]] = {}
    try:
        for s in range(start, end):
            if grain_it is None:
                batch = batches.batch(position)
                batch = {k: parallel.put_global(v, program.batch_shardings[k]) for k, v in batch.items()}
            else:
                batch = {k: parallel.put_process_local(v, program.batch_shardings[k], B)
                         for k, v in next(grain_it).items()}
            state, metrics = compiled(state, batch)
            position += B
            pending.append((s, metrics))
            done = s + 1
            progress.update(done)
            is_log = done % cfg.log_period == 0 or done == end
            is_ckpt = ckpt is not None and (done % cfg.checkpoint_period == 0 or done == cfg.steps)
            if is_log or is_ckpt:
                rows_since_log += fetch()
            if is_log:
                log_window(done, rows_since_log)
                rows_since_log = []
            if is_ckpt:
                ckpt.save(done, state, {"step": done, "data_position": position, "vocab_size": vocab,
                                        "table_rows": program.rows, "global_batch_size": B, "loss": cfg.loss,
                                        "seed": cfg.seed, "prng_impl": program.prng_impl},
                          data=None if grain_it is None else pipeline_lib.frozen_state(grain_it))
                last_saved = done
            if cfg.eval_interval and done % cfg.eval_interval == 0 and done < cfg.steps:
                res = _evaluate(program, state["params"], ds, "dev", max_users=cfg.eval_max_users)
                progress.clear()
                say(f"step {done} dev: " + _fmt_eval(res["model"]))
                writer.write(done, res["model"], prefix="dev")
        rows_since_log += fetch()
        log_window(end, rows_since_log)
    finally:
        progress.clear()

    if end >= cfg.steps:
        k = cfg.eval_top_k
        for name in ("dev", "test"):
            res = _evaluate(program, state["params"], ds, name, popularity_counts=ds.popularity)
            evals[name], evals[f"{name}_popularity"] = res["model"], res["popularity"]
            writer.write(end, res["model"], prefix=name)
            writer.write(end, res["popularity"], prefix=f"{name}_popularity")
        n_dev, n_test = ((int(evals["dev"]["users"]), int(evals["test"]["users"])) if grain_it is not None
                         else (ds.dev.num_users, ds.test.num_users))
        say(f"evaluation at step {end} (top-{k} over all {vocab - 1} items, {n_dev} dev / "
            f"{n_test} test users):")
        for name in ("dev", "test"):
            say(f"  {name:<4} SASRec     {_fmt_eval(evals[name])}")
            say(f"  {name:<4} popularity {_fmt_eval(evals[name + '_popularity'])}")
        if is_main:
            (run_dir / "eval_results.json").write_text(json.dumps({"step": end, **evals}, indent=2))
    say(f"run directory: {run_dir}")
    return TrainResult(run_dir, end, position, losses, evals, state, program)


def _fmt_eval(res: Dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in res.items() if k != "users")


def _report_config_changes(path: Path, cfg, say):
    import yaml
    try:
        old = yaml.safe_load(path.read_text()) or {}
    except Exception:  # an unreadable old copy only loses the diff
        return
    changed = {k: (old.get(k), cfg[k]) for k in cfg.keys() if k in old and old.get(k) != cfg[k]
               and not (isinstance(cfg[k], (list, tuple)) and list(cfg[k]) == old.get(k))}
    if changed:
        say("resuming with changed config keys: " +
            ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items()))


# ----------------------------------------------------------------------------- entry point
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    try:
        cfg = load_config(argv)
    except ConfigError as err:
        print(f"recloss-train: config error: {err}", file=sys.stderr)
        return 2
    try:
        if cfg.compile_topology:
            from recloss_plugins.sasrec import aot
            aot.compile_report(cfg, log=lambda *a: print(*a, flush=True))
            return 0
        distributed.initialize_from_env()
        if jax.process_index() == 0:
            print("config:\n" + "\n".join(f"  {line}" for line in dump_config(cfg).splitlines()), flush=True)
        train(cfg, log=lambda *a: print(*a, flush=True))
    except ConfigError as err:
        print(f"recloss-train: config error: {err}", file=sys.stderr)
        return 2
    except (data_lib.DataError, parallel.MeshError, NonFiniteLossError) as err:
        print(f"recloss-train: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
