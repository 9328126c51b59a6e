"""Run N processes of a JAX program on this machine, wired together as N hosts.

    python launch/local.py -n 2 -d 4 configs/base.yml steps=20 run_name=local2x4
    python launch/local.py -n 2 -d 4 --exec -- python my_script.py --flag

Without ``--exec`` every process runs ``recloss-train`` (``python -m
recloss_plugins.sasrec.train``) with the remaining arguments (a config file and
``key=value`` overrides); with ``--exec`` the arguments after ``--`` are the
command. Process ``i`` of ``N`` gets, on top of this environment:

    JAX_COORDINATOR_ADDRESS  127.0.0.1:<free port>   read by jax.distributed.initialize itself
    JAX_NUM_PROCESSES        N                       read by recloss-train (sasrec.distributed.initialize_from_env)
    JAX_PROCESS_ID           i                       read by recloss-train
    XLA_FLAGS                ... --xla_force_host_platform_device_count=K   (K = --devices-per-process)
    JAX_PLATFORMS            cpu (--platform; '' leaves it as it is)

so ``jax.distributed.initialize`` meets at the coordinator and the program sees
N·K global devices, K of them addressable, exactly as on N hosts. (JAX itself
reads only the address; an ``--exec`` program passes the other two, or calls
``recloss_plugins.sasrec.distributed.initialize_from_env()``, which does.) Each output
line is prefixed with ``[p<i>]``. When a process exits with a nonzero code the
others are stopped (SIGTERM, then SIGKILL after --grace seconds) and the
launcher exits with that code; Ctrl-C stops them all (exit 130); --timeout
stops them all after that many seconds (exit 124).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, TextIO

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_MODULE = "recloss_plugins.sasrec.train"
_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_device_count(xla_flags: str, count: int) -> str:
    """``xla_flags`` with ``--xla_force_host_platform_device_count`` set to ``count`` (replaced or appended)."""
    flag = f"--xla_force_host_platform_device_count={count}"
    if _DEVICE_FLAG.search(xla_flags):
        return _DEVICE_FLAG.sub(flag, xla_flags)
    return f"{xla_flags} {flag}".strip()


def child_env(base: Dict[str, str], *, process_id: int, num_processes: int, coordinator: str,
              devices_per_process: int, platform: str) -> Dict[str, str]:
    """The environment of process ``process_id`` (see the module docstring)."""
    env = dict(base)
    env.update(JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES=str(num_processes),
               JAX_PROCESS_ID=str(process_id), PYTHONUNBUFFERED="1",
               XLA_FLAGS=with_device_count(env.get("XLA_FLAGS", ""), devices_per_process))
    if platform:
        env["JAX_PLATFORMS"] = platform
    if platform == "cpu":
        # libtpu (installed with jax[tpu]) would otherwise probe the GCE metadata
        # server, and refuse to load in more than one process at a time.
        env.setdefault("TPU_SKIP_MDS_QUERY", "1")
        env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def exit_code(returncode: int) -> int:
    """A process return code as a shell exit status (killed by signal s -> 128 + s)."""
    return 128 - returncode if returncode < 0 else returncode


class _Stopped(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _pump(stream, prefix: str, out: TextIO, lock: threading.Lock):
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _stop(procs: Sequence[subprocess.Popen], grace: float):
    """SIGTERM to every live process group we started, then SIGKILL to those still alive after ``grace`` s."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def run_processes(commands: Sequence[Sequence[str]], envs: Sequence[Dict[str, str]], *,
                  timeout: Optional[float] = None, grace: float = 10.0, out: TextIO = None,
                  err: TextIO = None, poll_s: float = 0.05) -> int:
    """Starts ``commands[i]`` with ``envs[i]``, prefixes their output, waits, and returns the exit status.

    0 when every process exits 0; otherwise the status of the first process seen
    exiting nonzero (the others are stopped), 124 on ``timeout``, 130 on Ctrl-C,
    143 when the launcher itself gets SIGTERM.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    lock = threading.Lock()
    procs: List[subprocess.Popen] = []
    pumps: List[threading.Thread] = []

    def on_sigterm(signum, frame):
        raise _Stopped(128 + signum)

    old_handler = signal.signal(signal.SIGTERM, on_sigterm) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        for i, (cmd, env) in enumerate(zip(commands, envs)):
            # Own session: a signal to the launcher's terminal group does not hit the
            # children before the launcher decides, and killpg reaches their children.
            p = subprocess.Popen(list(cmd), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}] ", out, lock), daemon=True)
            t.start()
            pumps.append(t)
        start = time.monotonic()
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, c = failed[0]
                others = sum(c2 is None for c2 in codes)
                with lock:
                    err.write(f"[launch] process {i} exited with code {exit_code(c)}; "
                              f"stopping the other {others} running process(es)\n")
                    err.flush()
                _stop(procs, grace)
                return exit_code(c)
            if all(c == 0 for c in codes):
                return 0
            if timeout is not None and time.monotonic() - start > timeout:
                with lock:
                    err.write(f"[launch] timeout after {timeout:g}s; stopping every process\n")
                    err.flush()
                _stop(procs, grace)
                return 124
            time.sleep(poll_s)
    except KeyboardInterrupt:
        err.write("[launch] interrupted; stopping every process\n")
        _stop(procs, grace)
        return 130
    except _Stopped as stopped:
        err.write("[launch] terminated; stopping every process\n")
        _stop(procs, grace)
        return stopped.code
    finally:
        _stop(procs, grace)  # no-op unless an exception left processes running
        for t in pumps:
            t.join(timeout=5)
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch/local.py", description=__doc__.split("\n\n")[0],
        epilog="Arguments after the options go to recloss-train (config + key=value overrides), "
               "or with --exec form the command itself (put them after --).")
    parser.add_argument("-n", "--num-processes", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument("-d", "--devices-per-process", type=int, default=4,
                        help="CPU devices per process via XLA_FLAGS (default 4)")
    parser.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--platform", default="cpu",
                        help="JAX_PLATFORMS of the processes (default cpu; '' leaves it unset)")
    parser.add_argument("--exec", dest="exec_", action="store_true",
                        help="run the given command instead of recloss-train")
    parser.add_argument("--timeout", type=float, default=None, help="stop every process after this many seconds")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping processes (default 10)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="config and overrides, or the --exec command")
    ns = parser.parse_args(argv)
    if ns.num_processes < 1:
        parser.error(f"--num-processes must be >= 1, got {ns.num_processes}")
    if ns.devices_per_process < 1:
        parser.error(f"--devices-per-process must be >= 1, got {ns.devices_per_process}")
    if not 0 <= ns.port <= 65535:
        parser.error(f"--port must be in [0, 65535] (0 = pick a free one), got {ns.port}")
    if ns.args and ns.args[0] == "--":
        ns.args = ns.args[1:]
    if ns.exec_ and not ns.args:
        parser.error("--exec needs a command after --, e.g. --exec -- python script.py")
    return ns


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = parse_args(argv)
    command = list(ns.args) if ns.exec_ else [sys.executable, "-m", TRAIN_MODULE, *ns.args]
    coordinator = f"127.0.0.1:{ns.port or free_port()}"
    envs = [child_env(dict(os.environ), process_id=i, num_processes=ns.num_processes, coordinator=coordinator,
                      devices_per_process=ns.devices_per_process, platform=ns.platform)
            for i in range(ns.num_processes)]
    shown = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "XLA_FLAGS", "JAX_PLATFORMS")
    for i, env in enumerate(envs):
        assigns = " ".join(f"{k}={shlex.quote(env[k])}" for k in shown if k in env)
        print(f"[launch] process {i}/{ns.num_processes}: {assigns} {shlex.join(command)}", flush=True)
    return run_processes([command] * ns.num_processes, envs, timeout=ns.timeout, grace=ns.grace)


if __name__ == "__main__":
    sys.exit(main())
