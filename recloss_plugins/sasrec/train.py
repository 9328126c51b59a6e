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

from recloss_plugins.config import ConfigError, check_vocab, command_config, dump_config
from recloss_plugins.sasrec import data as data_lib
from recloss_plugins.sasrec import distributed
from recloss_plugins.sasrec import eval as eval_lib
from recloss_plugins.sasrec import parallel
from recloss_plugins.sasrec.data import pipeline as pipeline_lib
from recloss_plugins.sasrec.checkpoints import Checkpoints
from recloss_plugins.sasrec.logging_utils import (MetricsWriter, Progress, format_duration, format_eval,
                                                  format_loss_metrics, loss_metrics)
from recloss.aot import format_memory, memory_report
from recloss_plugins.sasrec.program import Program, counts_any, global_batch_size, program_for, proposal_of

USAGE = """usage: recloss-train [CONFIG.yml] [key=value ...]

Trains the multi-label SASRec reference model. CONFIG defaults to configs/base.yml,
which lists every key with a comment. Examples:
  recloss-train configs/base.yml loss=cutbce_pallas steps=100
  recloss-train configs/base.yml loss=cutce z_loss=1e-4 steps=100
  recloss-train configs/sasrec_yambda.yml compile_topology=v6e-8 loss=dense_bce
  recloss-train --table3 --json table3.json --rows V=876939,cutbce_pallas   (on a TPU: --table3 --help)
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


# ----------------------------------------------------------------------------- evaluation
def _evaluate(program: Program, params, ds, name: str, **kw) -> Dict[str, Dict[str, float]]:
    """`eval.evaluate` of split ``name``: for Grain data each process holds and scores its own users;
    an in-memory Dataset holds every user on every process (``replicated``)."""
    if isinstance(ds, pipeline_lib.GrainData):
        return eval_lib.evaluate(program, params, ds.eval_split(name), **kw)
    return eval_lib.evaluate(program, params, getattr(ds, name), replicated=True, **kw)


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
    global_batch_size(cfg, parallel.layout_for(mesh), len(devices))   # its split, before any data is read
    run_dir = _run_dir(cfg)  # before any work: a bad gs:// URL, missing credentials or bucket fail here
    if is_main:
        data_lib.make_dir(run_dir, "base_output_directory")

    t0 = time.perf_counter()
    if dataset is not None:
        ds = dataset
    elif pipeline_lib.uses_grain(cfg):
        ds = pipeline_lib.grain_data_for(cfg, jax.process_index(), jax.process_count(), log=say,
                                         progress_stream=progress_stream if is_main else None,
                                         client=distributed.coordination_client())
    else:
        ds = data_lib.build_dataset(cfg)
    vocab = ds.vocab_size
    if cfg.vocab_size:
        if cfg.vocab_size < vocab:
            raise ConfigError(f"config key 'vocab_size' is {cfg.vocab_size}, but the data has "
                              f"{vocab - 1} items (+1 padding = {vocab}); set vocab_size: 0 or >= {vocab}")
        vocab = cfg.vocab_size
    else:   # the data set V: the loss's limits on it (checked at load when the config fixes V)
        check_vocab(cfg, vocab, f"the data's {vocab - 1} items + the padding id")
    if isinstance(ds, pipeline_lib.GrainData):
        if ds.staged is not None:
            st = ds.staged
            say(f"data: process {ds.process_index} staged its {st['copied'] + st['reused']} shards of "
                f"{ds.manifest.path} in {st['dir']}: {st['copied']} copied"
                + (f" ({st['bytes'] / 2**20:.1f} MiB)" if st['copied'] else "")
                + f", {st['reused']} already there, each checked by size and SHA-256"
                + (f" ({st['unchecked']} by size only: prepared before checksums)" if st['unchecked'] else "")
                + f" ({st['seconds']:.1f}s)")
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

    program = program_for(cfg, mesh, vocab)
    B = program.batch_size
    if isinstance(ds, pipeline_lib.GrainData):
        ds.local_batch_size(B)  # B must split over the shards: a named error before any work
    say(f"mesh: {dict(mesh.shape)} over {len(devices)} {program.layout.platform} device(s); "
        f"loss={cfg.loss}; table rows {program.rows} (V={vocab}); global batch {B}")
    if program.strategy.objective == "sampled":
        chosen = "this loss's default" if cfg.sampled_proposal == "auto" else "set"
        say(f"sampled negatives: K={cfg.num_negatives} per step from the {proposal_of(cfg)} proposal ({chosen}), "
            f"accidental hits {'removed' if cfg.remove_accidental_hits else 'kept'}")
    if program.manual is not None:
        say(f"train step: data parallel under shard_map over {program.manual.batch_axes}, "
            f"gradients summed in place (recloss.psum_in_place)")
    say(parallel.describe_model_split(program.layout, program.model_batch_axes, B))
    if program.gather is not None:
        say(program.gather.describe())

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
    """The step loop: batches in, the compiled step, logging windows, checkpoints, periodic dev
    evaluation; then the final evaluation (`_final_eval`)."""
    B = program.batch_size
    grain_it = None
    if isinstance(ds, pipeline_lib.GrainData):  # this process's rows of each global batch, from its shards
        grain_it = ds.train_iterator(B, cfg.seed, read_threads=cfg.grain_read_threads,
                                     prefetch=cfg.grain_prefetch_buffer)
    state, position, start = _resume_or_init(cfg, program, vocab, run_dir, ckpt, grain_it, say)
    if is_main:
        (run_dir / "config.yml").write_text(dump_config(cfg))

    compiled = program.compiled_train_step()
    say(f"compiled train step, per-device memory: {format_memory(memory_report(compiled))}")
    counts = ds.popularity if program.inputs_shardings else None   # a counts proposal's logQ
    if counts is not None and not counts_any(counts, program.vocab_size):
        say("sampled_proposal=counts: the training split counts no item, so the negatives are drawn uniformly")
        counts = None
    inputs = program.step_inputs(counts)

    batches = data_lib.TrainBatches(ds.train, B, cfg.seed) if grain_it is None else None
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    log = _StepLog(cfg, program, writer, ckpt, say, Progress(cfg.steps, start, progress_stream), start)
    try:
        for s in range(start, end):
            if grain_it is None:
                batch = batches.batch(position)
                batch = {k: parallel.put_global(v, program.batch_shardings[k]) for k, v in batch.items()}
            else:
                batch = {k: parallel.put_process_local(v, program.batch_shardings[k], B)
                         for k, v in next(grain_it).items()}
            state, metrics = compiled(state, batch, inputs)
            position += B
            log.pending.append((s, metrics))
            done = s + 1
            log.progress.update(done)
            is_log = done % cfg.log_period == 0 or done == end
            is_ckpt = ckpt is not None and (done % cfg.checkpoint_period == 0 or done == cfg.steps)
            if is_log or is_ckpt:
                log.fetch()
            if is_log:
                log.window(done)
            if is_ckpt:
                ckpt.save(done, state, {"step": done, "data_position": position, "vocab_size": vocab,
                                        "table_rows": program.rows, "global_batch_size": B, "loss": cfg.loss,
                                        "seed": cfg.seed, "prng_impl": program.prng_impl,
                                        "process_count": jax.process_count()},
                          data=None if grain_it is None else pipeline_lib.frozen_state(grain_it))
                log.last_saved = done
            if cfg.eval_interval and done % cfg.eval_interval == 0 and done < cfg.steps:
                res = _evaluate(program, state["params"], ds, "dev", max_users=cfg.eval_max_users)
                log.progress.clear()
                say(f"step {done} dev: " + format_eval(res["model"]))
                writer.write(done, res["model"], prefix="dev")
        log.fetch()
        log.window(end)
    finally:
        log.progress.clear()

    evals = {}
    if end >= cfg.steps:
        evals = _final_eval(cfg, program, state, ds, writer, run_dir, end, vocab, say=say, is_main=is_main,
                            grain=grain_it is not None)
    say(f"run directory: {run_dir}")
    return TrainResult(run_dir, end, position, log.losses, evals, state, program)


def _resume_or_init(cfg, program, vocab, run_dir, ckpt, grain_it, say):
    """(state, data position, first step): the run's latest checkpoint, checked against this run (its
    PRNG implementation, shapes, vocabulary) and restored with the Grain iterator's state, or a fresh
    init."""
    if ckpt is None or ckpt.latest() is None:
        return program.init(), 0, 0
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
    saved = ckpt.data_states(latest) if grain_it is not None else {}
    elastic = bool(saved) and len(saved) != jax.process_count()
    try:
        state, meta = ckpt.restore(latest, program.abstract_state, data=None if elastic else grain_it)
    except Exception as err:  # shape/structure mismatch: a different model in this run_name
        raise ConfigError(f"cannot resume {run_dir} from step {latest}: {err}. The checkpoint was "
                          "written by a different model/vocabulary; use a new run_name") from err
    if meta.get("vocab_size") != vocab or meta.get("table_rows") != program.rows:
        raise ConfigError(f"cannot resume {run_dir}: its checkpoint has V={meta.get('vocab_size')}, "
                          f"{meta.get('table_rows')} rows; this run has V={vocab}, {program.rows} rows")
    position, start = int(meta["data_position"]), int(meta["step"])
    how = ""
    if elastic:
        _continue_grain(grain_it, saved, start, run_dir)
        how = (f"; saved by {len(saved)} processes, resumed on {jax.process_count()}: parameters and optimizer "
               f"state restored onto this mesh, and the input continues the same global order from global "
               f"batch {start}, as an uninterrupted run (each process's Grain position re-derived from the "
               f"step, which all {len(saved)} saved positions match)")
    say(f"resumed from {ckpt.directory} step {start} (data position {position}){how}")
    return state, position, start


def _continue_grain(grain_it, saved: dict, step: int, run_dir) -> None:
    """Sets a Grain iterator of this run to global batch ``step``, where a checkpoint saved by another
    process count left off. Every process's stream is global batch t = every shard's t-th B/S rows,
    whatever the process count, so its position is the step; the saved ones must all say so."""
    positions = {p: st.get("next_index") for p, st in saved.items()}
    if set(positions.values()) != {step}:
        raise ConfigError(f"cannot resume {run_dir} on {jax.process_count()} processes: its checkpoint at step "
                          f"{step} was saved by {len(saved)} processes whose input positions {positions} are not "
                          f"all {step}, so the global order cannot be re-derived; resume on {len(saved)} processes")
    fresh = grain_it.get_state()
    if set(fresh) != set(saved[0]):
        raise ConfigError(f"cannot resume {run_dir} on {jax.process_count()} processes: the saved input state "
                          f"has fields {sorted(saved[0])}, this run's has {sorted(fresh)} (another Grain version "
                          f"or pipeline); resume on {len(saved)} processes")
    grain_it.set_state({**fresh, "next_index": step})


class _StepLog:
    """The steps' metrics on their way to the log: ``pending`` device metrics, fetched to the host
    (`fetch`, which stops the run on the first non-finite step) and logged per window (`window`: the
    loss, the objective's metrics, rates and ETA to the terminal and the metric sinks)."""

    def __init__(self, cfg, program, writer, ckpt, say, progress, start: int):
        self.cfg, self.program, self.writer, self.ckpt, self.say = cfg, program, writer, ckpt, say
        self.progress = progress
        self.pending = []           # (step index, metrics) not yet fetched to the host
        self.rows = []              # fetched rows of the current window
        self.losses: Dict[int, float] = {}
        self.last_saved = ckpt.latest() if ckpt is not None else None
        self._t, self._step = time.perf_counter(), start

    def fetch(self):
        """Moves pending metrics to the host; raises on the first non-finite step."""
        rows = [(s, {k: _scalar(v) for k, v in m.items()}) for s, m in self.pending]
        self.pending.clear()
        for s, m in rows:
            if not m["finite"]:
                self.progress.clear()
                where = (f"the last good checkpoint is step {self.last_saved} in {self.ckpt.directory} "
                         "(left intact)" if self.last_saved is not None else "no checkpoint was written")
                raise NonFiniteLossError(
                    f"non-finite loss {m['loss']} (grad norm {m['grad_norm']}) at step {s + 1}; stopping. "
                    f"{where}. Lower learning_rate, enable grad_clip, or use dtype=float32.")
            self.losses[s] = m["loss"]
        self.rows += rows

    def window(self, done: int):
        """Logs the window of fetched rows that ends at step ``done`` and starts the next one."""
        rows, self.rows = self.rows, []
        if not rows:
            return
        cfg = self.cfg
        now = time.perf_counter()
        dt = max(now - self._t, 1e-9)
        steps_n = done - self._step
        loss = float(np.mean([m["loss"] for _, m in rows]))
        objective_metrics = loss_metrics(self.program.strategy.objective, rows)
        sps = steps_n / dt
        ips = sum(m.get("weight_sum", 0.0) for _, m in rows) / dt
        eta = (cfg.steps - done) / sps if sps > 0 else float("inf")
        last = rows[-1][1]
        self.progress.clear()
        shown = f" | {format_loss_metrics(objective_metrics)}" if objective_metrics else ""
        self.say(f"step {done}/{cfg.steps} | loss {loss:.6g}{shown} | "
                 f"grad_norm {last['grad_norm']:.3g} | lr {last['learning_rate']:.3g} | {sps:.2f} steps/s | "
                 f"{ips:,.0f} items/s | ETA {format_duration(eta)}")
        self.writer.write(done, {"loss": loss, **objective_metrics, "grad_norm": last["grad_norm"],
                                 "learning_rate": last["learning_rate"], "steps_per_sec": sps,
                                 "items_per_sec": ips})
        self._t, self._step = now, done


def _final_eval(cfg, program, state, ds, writer, run_dir, end: int, vocab: int, *, say, is_main: bool,
                grain: bool) -> Dict[str, Dict[str, float]]:
    """Dev and test Hit/Recall/NDCG of the model and of popularity at the last step: logged, written
    to the metric sinks and (process 0) to run_dir/eval_results.json."""
    evals: Dict[str, Dict[str, float]] = {}
    for name in ("dev", "test"):
        res = _evaluate(program, state["params"], ds, name, popularity_counts=ds.popularity)
        evals[name], evals[f"{name}_popularity"] = res["model"], res["popularity"]
        writer.write(end, res["model"], prefix=name)
        writer.write(end, res["popularity"], prefix=f"{name}_popularity")
    n_dev, n_test = ((int(evals["dev"]["users"]), int(evals["test"]["users"])) if grain
                     else (ds.dev.num_users, ds.test.num_users))
    say(f"evaluation at step {end} (top-{cfg.eval_top_k} over all {vocab - 1} items, {n_dev} dev / "
        f"{n_test} test users):")
    for name in ("dev", "test"):
        say(f"  {name:<4} SASRec     {format_eval(evals[name])}")
        say(f"  {name:<4} popularity {format_eval(evals[name + '_popularity'])}")
    if is_main:
        (run_dir / "eval_results.json").write_text(json.dumps({"step": end, **evals}, indent=2))
    return evals


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
    argv = sys.argv[1:] if argv is None else argv
    cfg, code = command_config("recloss-train", USAGE, argv)
    if cfg is None:
        return code
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
