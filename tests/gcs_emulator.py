"""A Cloud Storage emulator (PyPI gcp-storage-emulator) on 127.0.0.1 for the gs:// tests.

`Emulator.start` runs ``python -m gcp_storage_emulator start`` in memory on a free port,
with one bucket, and waits until it answers the JSON API; `env` is what points every
client at it through its documented setting:

    STORAGE_EMULATOR_HOST      gcsfs (so etils.epath), google-cloud-storage (tensorboardX)
    TENSORSTORE_GCS_HTTP_URL   TensorStore's GCS driver (Orbax's arrays)

pyarrow's own GcsFileSystem takes ``endpoint_override``/``scheme`` arguments (`arrow_fs`).

Run as a script, this file is the emulator with two fixes. Its server is made threaded
(`_threaded_server`), and its media downloads, which carry no
``x-goog-generation`` header and ignore ``ifGenerationMatch``/``ifGenerationNotMatch``,
which real Cloud Storage honours and TensorStore relies on (Orbax's OCDBT manifest is
re-read conditionally; a 200 without a generation is "Malformed StorageGeneration"),
get both (`_patch_downloads`) before the server's routes are built.

A start that fails raises RuntimeError with the emulator's output: the tests then fail
saying why, they are not skipped.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, Optional


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    def __init__(self, log_path: Path, bucket: str = "bucket", script: Optional[Path] = None):
        self.log_path = Path(log_path)
        self.script = Path(script or __file__).resolve()   # what runs the emulator (this file)
        self.bucket = bucket
        self.port: Optional[int] = None
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> Dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
                # The emulator has no storage-control (gRPC) API; gcsfs would probe it on every call.
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def start(self, timeout_s: float = 30.0) -> "Emulator":
        try:
            import gcp_storage_emulator  # noqa: F401
        except ImportError as err:
            raise RuntimeError("the gs:// tests need the Cloud Storage emulator: pip install gcp-storage-emulator "
                               f"(it is in the 'test' extra of pyproject.toml; `make test` installs it): {err}")
        self.port = _free_port()
        cmd = [sys.executable, str(self.script), "start", "--host", "127.0.0.1",
               "--port", str(self.port), "--in-memory", "--default-bucket", self.bucket, "--quiet"]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Cloud Storage emulator exited with code {self.proc.returncode} at start "
                                   f"({' '.join(cmd)}); its output:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b/{self.bucket}", timeout=1) as r:
                    if json.load(r).get("name") == self.bucket:
                        return self
            except OSError as err:
                last = err
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the Cloud Storage emulator did not answer on {self.url} within {timeout_s:g}s "
                           f"(last error: {last}); its output:\n{self.output()}")

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def arrow_fs(self):
        """pyarrow's native GcsFileSystem pointed at the emulator (anonymous, plain http)."""
        import pyarrow.fs as pafs
        return pafs.GcsFileSystem(anonymous=True, endpoint_override=f"127.0.0.1:{self.port}", scheme="http")

    def objects(self, prefix: str = "") -> list:
        """Names of the bucket's objects under ``prefix``, straight from the JSON API."""
        names, token = [], ""
        while True:
            q = f"prefix={urllib.request.quote(prefix)}" + (f"&pageToken={token}" if token else "")
            with urllib.request.urlopen(f"{self.url}/storage/v1/b/{self.bucket}/o?{q}", timeout=10) as r:
                page = json.load(r)
            names += [o["name"] for o in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(names)


def _patch_downloads():
    """Media downloads as Cloud Storage answers them: the generation headers and the
    ifGenerationMatch (412) / ifGenerationNotMatch (304) preconditions."""
    from http import HTTPStatus

    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    original = objects.download

    def download(request, response, storage, *args, **kwargs):
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except NotFound:
            return original(request, response, storage, *args, **kwargs)
        generation = str(obj["generation"])
        response["x-goog-generation"] = generation
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
        match = request.query.get("ifGenerationMatch", [None])[0]
        not_match = request.query.get("ifGenerationNotMatch", [None])[0]
        if match is not None and match != generation:
            response.status = HTTPStatus.PRECONDITION_FAILED
            return None
        if not_match is not None and not_match == generation:
            response.status = HTTPStatus.NOT_MODIFIED
            return None
        return original(request, response, storage, *args, **kwargs)

    objects.download = download


def _threaded_server():
    """One thread per connection, as a real endpoint serves: the emulator's single-threaded
    HTTPServer blocks every other connection while a client keeps one alive, and gcsfs
    (aiohttp) reading a file in parallel ranges over a pool of connections then waits forever."""
    import functools
    import http.server
    import threading

    from gcp_storage_emulator import server as emulator_server
    assert emulator_server.server is http.server
    http.server.HTTPServer = http.server.ThreadingHTTPServer   # this emulator process only
    # Its storage is not thread-safe (resumable uploads get lost): writes are handled one at a
    # time. Reads stay parallel: a reader may hold a large response half-sent while it waits
    # for another range, and a lock held across that would deadlock.
    lock = threading.Lock()
    handler = emulator_server.RequestHandler
    for name in [n for n in vars(handler) if n.startswith("do_") and n != "do_GET"]:
        def locked(self, *args, _method=getattr(handler, name), **kwargs):
            with lock:
                return _method(self, *args, **kwargs)
        setattr(handler, name, functools.wraps(getattr(handler, name))(locked))


if __name__ == "__main__":
    _patch_downloads()
    _threaded_server()
    from gcp_storage_emulator.__main__ import main

    main(sys.argv[1:])
