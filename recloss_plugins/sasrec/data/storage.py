"""Where recloss-train's files live: local paths and ``gs://bucket/prefix`` URLs, one path type.

Every path the trainer reads or writes (run directories, config.yml, metrics.jsonl,
eval_results.json, TensorBoard events, Orbax checkpoints, dataset_path) goes through
`as_path`, which returns an ``etils.epath.Path``: a local directory, or a Cloud Storage
prefix opened through fsspec/gcsfs. Orbax takes the same object and writes arrays with
TensorStore's own GCS driver.

Credentials are Google's Application Default Credentials (GOOGLE_APPLICATION_CREDENTIALS,
``gcloud auth application-default login``, or a TPU/GCE VM's service account); `as_path`
checks them once, before any work, so a missing login is one clear error rather than a
retry loop deep in a checkpoint save.

An emulator (tests, local experiments) is reached by ``STORAGE_EMULATOR_HOST=http://host:port``,
the variable gcsfs and the Google client libraries read, without credentials. TensorStore
reads its own ``TENSORSTORE_GCS_HTTP_URL``; `as_path` sets it to the emulator's address
when only STORAGE_EMULATOR_HOST is given.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Mapping, Optional

from etils import epath

from recloss_plugins.config import ConfigError

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
TENSORSTORE_ENV = "TENSORSTORE_GCS_HTTP_URL"
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$")
_credentials_found = False   # Application Default Credentials found once: not looked up again


class StorageError(ConfigError):
    """A storage URL is malformed, or Cloud Storage cannot be reached as configured."""


def emulator_url(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``http://host:port`` of the Cloud Storage emulator STORAGE_EMULATOR_HOST names, or None."""
    env = os.environ if env is None else env
    host = env.get(EMULATOR_ENV, "").strip()
    if host in ("", "default"):
        return None
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def check_credentials(key: str, value: str, env: Optional[Mapping[str, str]] = None) -> None:
    """Raises StorageError unless gs:// access is possible: an emulator is set, or Google
    Application Default Credentials are found (and gcsfs, the gs:// backend, is installed)."""
    env = os.environ if env is None else env
    emulator = emulator_url(env)
    try:
        import gcsfs  # noqa: F401  (the fsspec backend etils.epath uses for gs://)
    except ImportError:
        raise StorageError(f"config key {key!r} is {value!r}, but gcsfs (the gs:// backend) is not "
                           "installed: pip install gcsfs") from None
    global _credentials_found
    if emulator is not None or _credentials_found:
        return
    import google.auth
    import google.auth.exceptions
    try:
        google.auth.default()
    except google.auth.exceptions.DefaultCredentialsError as err:
        raise StorageError(
            f"config key {key!r} is {value!r}, but no Google Cloud credentials were found ({err}). "
            "Set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, run "
            "`gcloud auth application-default login`, or run on a TPU/GCE VM whose service account "
            f"can use the bucket; for a local emulator set {EMULATOR_ENV}=http://127.0.0.1:PORT") from None
    _credentials_found = True


def as_path(value, key: str = "path", *, check: bool = True) -> epath.Path:
    """``value`` (a local path or a ``gs://bucket/prefix`` URL) as an etils.epath.Path.

    Local paths are expanded (``~``) and made absolute. ``gs://`` URLs need a bucket name
    and, with ``check``, reachable storage (`check_credentials`). Raises StorageError naming
    ``key`` (the config key the value came from) for another scheme, a URL without a bucket,
    or missing credentials."""
    text = os.fspath(value)
    match = _URI.match(text)
    if match is None:
        return epath.Path(pathlib.Path(text).expanduser().resolve())
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme != "gs":
        raise StorageError(f"config key {key!r} is {text!r}: unsupported URL scheme {scheme + '://'!r}; "
                           "use a local path or gs://BUCKET/PREFIX")
    bucket = rest.split("/", 1)[0]
    if not bucket:
        raise StorageError(f"config key {key!r} is {text!r}, which names no bucket; "
                           "expected gs://BUCKET/PREFIX (e.g. gs://my-bucket/runs)")
    if not re.fullmatch(r"[a-z0-9][a-z0-9._\-]{1,221}[a-z0-9]", bucket):
        raise StorageError(f"config key {key!r} is {text!r}: {bucket!r} is not a valid bucket name "
                           "(3-222 characters: lower-case letters, digits, '-', '_', '.')")
    if check:
        check_credentials(key, text)
    emulator = emulator_url()
    if emulator is not None:
        os.environ.setdefault(TENSORSTORE_ENV, emulator)
        # TensorStore's own emulator tests set this: a fixed token the emulator ignores, instead of a
        # search for credentials that ends in an "E ... Could not find the credentials file" line.
        os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
        # The emulator has no storage-control API: keep gcsfs from probing it on every call.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    return epath.Path(f"gs://{rest.rstrip('/')}" if rest.rstrip("/") else f"gs://{bucket}")


def make_dir(path: epath.Path, key: str = "path") -> None:
    """``path.mkdir(parents=True, exist_ok=True)``; a missing bucket is a StorageError naming ``key``
    (buckets are never created here: a misspelt name would otherwise make a new one)."""
    # Object stores have no directories (mkdir is a no-op there), so the bucket is checked itself.
    match = _URI.match(str(path))
    bucket = epath.Path(f"gs://{match.group(2).split('/', 1)[0]}") if match else None
    try:
        if bucket is not None and not bucket.exists():
            raise FileNotFoundError(f"bucket {str(bucket)!r} does not exist")
        path.mkdir(parents=True, exist_ok=True)
    except FileNotFoundError as err:
        raise StorageError(f"cannot create {str(path)!r} (config key {key!r}): {err}. A gs:// bucket "
                           "must exist first: gcloud storage buckets create gs://BUCKET") from err
