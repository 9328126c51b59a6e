"""gs:// paths end to end against a Cloud Storage emulator on 127.0.0.1 (tests/gcs_emulator.py).

Training to gs://bucket/... and resuming from it gives the parameters of an uninterrupted run,
with config.yml, metrics.jsonl, eval_results.json, TensorBoard events and Orbax checkpoints
(keep-N) in the bucket; a Parquet/CSV log read from the bucket is the dataset of its local copy;
two processes (launch/local.py) checkpoint to and resume from the same bucket exactly; bad
URLs, missing objects or buckets and missing credentials are named errors.

Run as a script (``python tests/test_gcs.py worker ...``) this file is one process of the
two-process run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "synthetic_num_users=48", "synthetic_num_items=511", "synthetic_min_len=20", "synthetic_max_len=30",
    "synthetic_num_intents=4", "synthetic_intents_per_user=2", "num_labels=4", "max_seq_len=8",
    "global_batch_size=16", "emb_dim=16", "num_layers=1", "num_heads=2", "mlp_dim=32", "dropout=0.1",
    "learning_rate=3e-3", "warmup_steps=2", "eval_batch_size=32", "eval_block_v=200",
    # The knobs of test_train's resume test: one compile of the cutbce program per session.
    "steps=7", "checkpoint_period=2", "log_period=1", "loss=cutbce",
]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator, with os.environ pointing every client at it while this module runs."""
    from gcs_emulator import Emulator
    em = Emulator(tmp_path_factory.mktemp("gcs") / "emulator.log")
    try:
        em.start()
    except RuntimeError as err:  # fail, never skip: the gs:// support would go untested
        pytest.fail(str(err), pytrace=False)
    saved = {k: os.environ.get(k) for k in em.env}
    os.environ.update(em.env)
    try:
        yield em
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        em.stop()


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def _cfg(base, *extra):
    from recloss_plugins.config import default_config_path, load_config
    return load_config([str(default_config_path()), *TINY, f"base_output_directory={base}", *extra])


def _params(result):
    import jax
    return [np.asarray(x) for x in jax.tree.leaves(result.state["params"])]


# ----------------------------------------------------------------------------- one process
@pytest.mark.tier2
def test_train_to_bucket_and_resume_equals_uninterrupted(gcs, tmp_path, monkeypatch):
    import jax
    from etils import epath

    from recloss_plugins.sasrec import data as D
    from recloss_plugins.sasrec.checkpoints import Checkpoints
    from recloss_plugins.sasrec.train import train

    monkeypatch.chdir(tmp_path)  # nothing may land on the local disk
    base = f"gs://{gcs.bucket}/{_prefix()}/runs"
    quiet = dict(devices=jax.devices()[:1], log=lambda *a: None)
    ds = D.build_dataset(_cfg(base))
    full = train(_cfg(base, "run_name=full", "max_checkpoints_to_keep=2"), dataset=ds, **quiet)
    # Preempted after step 5: the last checkpoint is step 4; step 5 is redone on resume.
    cut = train(_cfg(base, "run_name=cut", "max_checkpoints_to_keep=2"), dataset=ds, stop_after=5, **quiet)
    assert cut.steps_done == 5 and not cut.evals
    logs = []
    resumed = train(_cfg(base, "run_name=cut", "max_checkpoints_to_keep=2"), dataset=ds, devices=quiet["devices"],
                    log=logs.append)
    assert any("resumed from gs://" in l and "step 4" in l for l in logs), logs
    assert sorted(resumed.losses) == [4, 5, 6]
    for s in (4, 5, 6):
        assert resumed.losses[s] == full.losses[s]
    assert max(full.losses.values()) - min(full.losses.values()) > 1e-4   # training moved
    for a, b in zip(_params(full), _params(resumed)):
        np.testing.assert_array_equal(a, b)
    assert resumed.evals["test"] == full.evals["test"]

    # Every artifact is an object in the bucket; nothing was written locally.
    assert str(resumed.run_dir) == f"{base}/cut" and list(tmp_path.iterdir()) == []
    run = epath.Path(f"{base}/cut")
    assert "run_name: cut" in (run / "config.yml").read_text()
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    # Rewritten whole on each flush: the lines of the first attempt stay, the resumed ones follow.
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3, 4, 5, 5, 6, 7]
    assert {r["split"] for r in rows} >= {"dev", "test", "dev_popularity", "test_popularity"}
    res = json.loads((run / "eval_results.json").read_text())
    assert res["step"] == 7 and res["test"] == full.evals["test"]
    events = list((run / "tensorboard").iterdir())   # one per attempt (one name if in the same second)
    assert events and all(e.name.startswith("events.out.tfevents.") for e in events)
    assert all(b"train/loss" in e.read_bytes() for e in events)
    # keep-N on the bucket: checkpoints 2 and 4 of the first attempt, 6 and 7 kept after the resume.
    names = gcs.objects(f"{base.split('/', 3)[3]}/cut/checkpoints/")
    assert sorted({int(n.split("/")[4]) for n in names}) == [6, 7]
    ckpt = Checkpoints(run / "checkpoints", 0)
    assert ckpt.manager.all_steps() == [6, 7]
    ckpt.close()


def _log(rng, n_users=30, n_rows=600):
    import pyarrow as pa
    users = np.array([f"u{i:03d}" for i in rng.integers(0, n_users, n_rows)])
    items = rng.integers(10, 10 + 97, n_rows) * 7            # raw ids, not 1..K
    times = rng.integers(0, 50, n_rows)                       # duplicate timestamps: file order breaks ties
    return pa.table({"uid": users, "item_id": items, "timestamp": times,
                     "is_organic": rng.integers(0, 2, n_rows), "played_ratio_pct": rng.uniform(0, 100, n_rows)})


def _same(a, b):
    np.testing.assert_array_equal(a.items, b.items)
    np.testing.assert_array_equal(a.offsets, b.offsets)
    np.testing.assert_array_equal(a.item_raw_ids, b.item_raw_ids)
    assert a.num_items == b.num_items


@pytest.mark.tier1
def test_parquet_and_csv_from_bucket_equal_local_copy(gcs, tmp_path, rng):
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from recloss_plugins.sasrec import data as D

    prefix = _prefix()
    fs = gcs.arrow_fs()    # uploaded with pyarrow's own GCS client, read back through gcsfs
    table = _log(rng)
    pq.write_table(table, tmp_path / "log.parquet")
    pq.write_table(table, f"{gcs.bucket}/{prefix}/data/log.parquet", filesystem=fs)
    remote = f"gs://{gcs.bucket}/{prefix}/data/log.parquet"
    local = D.load_interactions(str(tmp_path / "log.parquet"), min_user_interactions=3)
    _same(D.load_interactions(remote, min_user_interactions=3), local)
    assert local.num_users > 10

    # A prefix of several files (Parquet and CSV) is the directory of the same files.
    (tmp_path / "parts").mkdir()
    half = table.num_rows // 2
    for name, part in (("a.parquet", table.slice(0, half)), ("b.csv", table.slice(half))):
        if name.endswith(".csv"):
            pacsv.write_csv(part, tmp_path / "parts" / name)
            with fs.open_output_stream(f"{gcs.bucket}/{prefix}/parts/{name}") as f:
                f.write((tmp_path / "parts" / name).read_bytes())
        else:
            pq.write_table(part, tmp_path / "parts" / name)
            pq.write_table(part, f"{gcs.bucket}/{prefix}/parts/{name}", filesystem=fs)
    _same(D.load_interactions(f"gs://{gcs.bucket}/{prefix}/parts"), D.load_interactions(str(tmp_path / "parts")))

    # Yambda's reader with its filters, and the config path through build_dataset.
    kw = dict(organic_only=True, min_played_ratio_pct=30.0, min_user_interactions=2)
    _same(D.load_yambda(remote, **kw), D.load_yambda(str(tmp_path / "log.parquet"), **kw))
    common = ("dataset_type=interactions", "data_pipeline=memory")
    a = D.build_dataset(_cfg(tmp_path, *common, f"dataset_path={remote}"))
    b = D.build_dataset(_cfg(tmp_path, *common, f"dataset_path={tmp_path / 'log.parquet'}"))
    np.testing.assert_array_equal(a.train.inputs, b.train.inputs)
    np.testing.assert_array_equal(a.popularity, b.popularity)


@pytest.mark.tier1
def test_reading_and_preparing_from_the_bucket_leave_nothing_pending_at_exit(gcs, tmp_path, rng):
    """Every gcsfs handle is closed: a left-open read's prefetch task makes asyncio print
    "Task was destroyed but it is pending!" at interpreter exit."""
    import pyarrow.parquet as pq
    prefix = f"gs://{gcs.bucket}/{_prefix()}"
    pq.write_table(_log(rng, n_rows=3000), f"{prefix[5:]}/log.parquet", filesystem=gcs.arrow_fs())
    code = ("import sys; from recloss_plugins.sasrec import data as D; "
            "from recloss_plugins.sasrec.data.prepare import main; "
            f"D.load_interactions('{prefix}/log.parquet', min_user_interactions=3); "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, str(REPO / "configs" / "base.yml"), "dataset_type=interactions",
                        f"dataset_path={prefix}/log.parquet", f"prepared_data_path={prefix}/prep",
                        "min_user_interactions=3", "prepare_num_shards=2", "prepare_num_buckets=3"],
                       capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "prepared gs://" in r.stdout
    assert "pending" not in r.stderr and "Task was destroyed" not in r.stderr, r.stderr


@pytest.mark.tier1
def test_emulator_that_cannot_start_says_why(tmp_path):
    from gcs_emulator import Emulator
    script = tmp_path / "broken.py"
    script.write_text("import sys; print('address already in use (simulated)'); sys.exit(3)\n")
    with pytest.raises(RuntimeError) as err:
        Emulator(tmp_path / "log", script=script).start(timeout_s=20)
    assert "emulator exited with code 3 at start" in str(err.value)
    assert "address already in use (simulated)" in str(err.value)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.tier1
@pytest.mark.parametrize("url, message", [
    ("gs://", "names no bucket; expected gs://BUCKET/PREFIX"),
    ("gs:///runs", "names no bucket; expected gs://BUCKET/PREFIX"),
    ("gs://My_Bucket/runs", "'My_Bucket' is not a valid bucket name"),
    ("s3://bucket/runs", "unsupported URL scheme 's3://'; use a local path or gs://BUCKET/PREFIX"),
])
def test_malformed_urls_are_named_errors(url, message):
    from recloss_plugins.config import ConfigError
    from recloss_plugins.sasrec import data as D
    with pytest.raises(D.StorageError) as err:
        D.as_path(url, "base_output_directory")
    assert isinstance(err.value, ConfigError)
    assert f"config key 'base_output_directory' is {url!r}" in str(err.value) and message in str(err.value)


@pytest.mark.tier1
def test_missing_object_and_bucket_are_named_errors(gcs, tmp_path, capsys):
    from recloss_plugins.config import default_config_path
    from recloss_plugins.sasrec import data as D
    from recloss_plugins.sasrec.train import main

    missing = f"gs://{gcs.bucket}/{_prefix()}/no/log.parquet"
    with pytest.raises(D.DataError, match=f"dataset_path '{missing}' does not exist"):
        D.load_interactions(missing)
    rc = main([str(default_config_path()), *TINY, "base_output_directory=gs://no-such-bucket/runs", "run_name=x"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "config key 'base_output_directory'" in err and "gcloud storage buckets create" in err


@pytest.mark.tier1
def test_no_credentials_outside_the_emulator_is_a_named_error(tmp_path, monkeypatch, capsys):
    from recloss_plugins.config import default_config_path
    from recloss_plugins.sasrec import data as D
    from recloss_plugins.sasrec.data import storage
    from recloss_plugins.sasrec.train import main

    for key in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))      # no gcloud application-default login
    # (and, offline and off Google Cloud, no VM metadata server)
    monkeypatch.setattr(storage, "_credentials_found", False)
    for key, args in (("base_output_directory", ["base_output_directory=gs://bucket/runs"]),
                      ("dataset_path", [f"base_output_directory={tmp_path}", "dataset_type=interactions",
                                        "data_pipeline=memory", "dataset_path=gs://bucket/data/log.parquet"])):
        rc = main([str(default_config_path()), *TINY, "run_name=x", *args])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert f"config key {key!r} is 'gs://bucket/" in err and "no Google Cloud credentials were found" in err
        assert "GOOGLE_APPLICATION_CREDENTIALS" in err and "STORAGE_EMULATOR_HOST" in err
    with pytest.raises(D.StorageError, match="gcloud auth application-default login"):
        D.as_path("gs://bucket/runs", "base_output_directory")


# ----------------------------------------------------------------------------- two processes
TWO = ["ici_fsdp_parallelism=2", "ici_vocab_parallelism=2", "enable_tensorboard=false", "steps=5",
       "eval_max_users=16"]


@pytest.mark.tier2
def test_two_processes_checkpoint_to_bucket_and_resume_exactly(gcs, tmp_path):
    base = f"gs://{gcs.bucket}/{_prefix()}/runs"
    out = tmp_path / "result.npz"
    env = dict(os.environ, **gcs.env)
    res = subprocess.run([sys.executable, str(REPO / "launch" / "local.py"), "-n", "2", "-d", "2", "--timeout", "300",
                          "--exec", "--", sys.executable, str(Path(__file__).resolve()), "worker", base, str(out)],
                         capture_output=True, text=True, timeout=360, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert "[p0] resumed from gs://" in res.stdout and "step 2" in res.stdout
    # Quiet on the emulator: TensorStore (Orbax's arrays) does not search for credentials.
    assert "Could not find the credentials file" not in res.stdout + res.stderr
    got = np.load(out)
    full = [got[k] for k in sorted(got.files) if k.startswith("full")]
    resumed = [got[k] for k in sorted(got.files) if k.startswith("resumed")]
    assert len(full) == len(resumed) > 0
    for a, b in zip(full, resumed):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got["loss_full"], got["loss_resumed"])
    # Both processes wrote their shards of the checkpoint to the bucket; only process 0 the small files.
    names = gcs.objects(f"{base.split('/', 3)[3]}/cut/")
    assert any("/checkpoints/5/state/ocdbt.process_1/" in n for n in names)
    assert any("/checkpoints/5/state/ocdbt.process_0/" in n for n in names)
    assert {n.rsplit("/", 1)[1] for n in names if "/checkpoints/" not in n} == {
        "config.yml", "metrics.jsonl", "eval_results.json"}


def _worker(base: str, out: str):
    """One of two processes: an uninterrupted run, a run stopped after step 3, its resume."""
    from recloss_plugins.sasrec import distributed
    distributed.initialize_from_env()
    import jax

    from recloss_plugins.sasrec import parallel
    from recloss_plugins.sasrec.train import train

    assert jax.process_count() == 2 and jax.device_count() == 4   # a (1, 2, 2) mesh over both
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    full = train(_cfg(base, *TWO, "run_name=full"), log=say)
    train(_cfg(base, *TWO, "run_name=cut"), stop_after=3, log=say)
    resumed = train(_cfg(base, *TWO, "run_name=cut"), log=say)
    arrays = {}
    for name, r in (("full", full), ("resumed", resumed)):
        for i, leaf in enumerate(jax.tree.leaves(r.state["params"])):
            arrays[f"{name}_{i:03d}"] = parallel.to_host(leaf)
    arrays["loss_full"] = np.array([full.losses[s] for s in (3, 4)])
    arrays["loss_resumed"] = np.array([resumed.losses[s] for s in (3, 4)])
    if jax.process_index() == 0:
        np.savez(out, **arrays)


# A log in the bucket, trained on with prepared_data_path empty: 2 processes x 2 devices, 4 shards.
FROM_LOG = ["dataset_type=interactions", "min_user_interactions=12", "prepare_num_shards=4",
            "prepare_num_buckets=3", "ici_fsdp_parallelism=2", "ici_vocab_parallelism=2",
            "enable_tensorboard=false", "steps=3", "eval_max_users=16", "enable_checkpointing=false"]


@pytest.mark.tier2
def test_two_processes_train_a_bucket_log_prepared_once_and_staged_per_host(gcs, tmp_path, rng):
    """Process 0 prepares the log into the bucket while process 1 waits; each stages and checks only its
    own two shards; a second run reuses both the preparation and the staged copies."""
    import pyarrow.parquet as pq
    prefix = f"{gcs.bucket}/{_prefix()}"
    pq.write_table(_log(rng, n_users=40, n_rows=1600), f"{prefix}/log.parquet", filesystem=gcs.arrow_fs())
    env = dict(os.environ, **gcs.env)
    res = subprocess.run([sys.executable, str(REPO / "launch" / "local.py"), "-n", "2", "-d", "2", "--timeout", "300",
                          "--exec", "--", sys.executable, str(Path(__file__).resolve()), "from-log",
                          f"gs://{prefix}", str(tmp_path)],
                         capture_output=True, text=True, timeout=360, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert "Task was destroyed" not in res.stdout + res.stderr
    assert f"[p0] data: preparing gs://{prefix}/log.parquet once into gs://{prefix}/runs/prepared/" in res.stdout
    assert "[p0] data: reusing gs://" in res.stdout
    (folder,) = {n.split("/")[3] for n in gcs.objects(f"{prefix.split('/', 1)[1]}/runs/prepared/")}
    staged = [json.loads((tmp_path / f"staged_p{p}.json").read_text()) for p in (0, 1)]
    for p, runs in enumerate(staged):
        first, second = runs
        assert first["shards"] == second["shards"] == [2 * p, 2 * p + 1]         # its own shards only
        assert (first["copied"], first["reused"], first["unchecked"]) == (2, 0, 0)
        assert (second["copied"], second["reused"]) == (0, 2)
        assert first["path"].endswith(folder) and first["dir"] == str(tmp_path / "stage")
    # Both processes share this machine's stage folder: the four checked shards, no partial copy.
    assert sorted(os.listdir(tmp_path / "stage")) == [f"part-{s:05d}-of-00004.arrayrecord" for s in range(4)]
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert len(losses) == 2 and all(np.isfinite(v) for run in losses for v in run.values())
    assert losses[0] == losses[1]             # the reused preparation and copies are the same data


def _from_log_worker(base: str, out: str):
    """One of two processes: two recloss-train runs on base/log.parquet, recording what each staged."""
    from recloss_plugins.sasrec import distributed
    distributed.initialize_from_env()
    import jax

    from recloss_plugins.sasrec.data import shards
    from recloss_plugins.sasrec.train import train

    me, runs, real_stage = jax.process_index(), [], shards.stage

    def recording_stage(manifest, shard_ids, stage_dir=None):
        paths, info = real_stage(manifest, shard_ids, stage_dir)
        runs.append({**info, "shards": list(shard_ids), "path": manifest.path})
        return paths, info

    shards.stage = recording_stage
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    args = [*FROM_LOG, f"dataset_path={base}/log.parquet", f"prepared_stage_dir={out}/stage"]
    losses = [train(_cfg(f"{base}/runs", *args, f"run_name={name}"), log=say).losses for name in ("a", "b")]
    Path(out, f"staged_p{me}.json").write_text(json.dumps(runs))
    if me == 0:
        Path(out, "losses.json").write_text(json.dumps([{str(k): float(v) for k, v in r.items()} for r in losses]))


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.path.insert(0, str(REPO))
    _worker(sys.argv[2], sys.argv[3])
if __name__ == "__main__" and sys.argv[1:2] == ["from-log"]:
    sys.path.insert(0, str(REPO))
    _from_log_worker(sys.argv[2], sys.argv[3])
