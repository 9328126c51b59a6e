"""Data files -> numpy columns: finding the files, telling their format, reading them with pyarrow.

CSV and TSV files need a header row; Parquet files carry their own schema. Paths are
local or ``gs://`` (`storage.as_path`); pyarrow reads through the path's fsspec
filesystem: its own native reader for local files, gcsfs for Cloud Storage.
"""

from __future__ import annotations

import difflib
import os
from typing import Dict, List, Sequence

import fsspec
import numpy as np
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from etils import epath

from recloss_plugins.sasrec.data.errors import DataError
from recloss_plugins.sasrec.data.storage import as_path

_EXT_FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".parquet": "parquet", ".pq": "parquet"}


def format_of(path: epath.Path, file_format: str) -> str:
    """``file_format`` unless it is 'auto', else the format (csv, tsv, parquet) of ``path``'s extension."""
    if file_format != "auto":
        return file_format
    suffixes = [s.lower() for s in path.suffixes]
    for s in reversed(suffixes):
        if s in _EXT_FORMATS:
            return _EXT_FORMATS[s]
    raise DataError(f"cannot tell the format of {str(path)!r} from its extension; set file_format to "
                    f"csv, tsv or parquet (known extensions: {sorted(_EXT_FORMATS)})")


def data_files(path: str, file_format: str) -> List[epath.Path]:
    """[path] for a file; for a directory (or a gs:// prefix), its data files (of ``file_format``,
    or any known one), sorted."""
    p = as_path(path, "dataset_path")
    if not p.exists():
        raise DataError(f"dataset_path {path!r} does not exist (no file, directory, object or prefix {str(p)!r})")
    if p.is_file():
        return [p]
    exts = ([e for e, f in _EXT_FORMATS.items() if f == file_format] if file_format != "auto"
            else list(_EXT_FORMATS))
    files = sorted(f for f in p.iterdir() if f.is_file() and "".join(f.suffixes[-1:]).lower() in exts)
    if not files:
        raise DataError(f"dataset_path {path!r} is a directory without data files "
                        f"(looked for {sorted(exts)})")
    return files


def _missing(col: str, have: Sequence[str], path, key: str) -> DataError:
    close = difflib.get_close_matches(col, list(have), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return DataError(f"{str(path)!r} has no column {col!r} (config key {key!r}); its columns are "
                     f"{list(have)}{hint}")


def open_parquet(handle, path, columns: Dict[str, str], optional: Sequence[str] = ()):
    """(ParquetFile of ``handle``, the columns to read): the named ones, checked to exist (a
    missing one is a DataError naming its config key), then the present ``optional`` ones."""
    try:
        pf = pq.ParquetFile(handle)
    except Exception as err:  # pyarrow raises several types for corrupt files
        raise DataError(f"{str(path)!r} is not a readable Parquet file: {err}") from err
    names = list(pf.schema_arrow.names)
    for key, col in columns.items():
        if col not in names:
            raise _missing(col, names, path, key)
    return pf, list(dict.fromkeys(list(columns.values()) + [c for c in optional if c in names]))


def read_columns(path: epath.Path, fmt: str, columns: Dict[str, str], optional: Sequence[str] = ()
                 ) -> Dict[str, np.ndarray]:
    """{column: numpy array} of the named (and present optional) columns of one file.

    ``columns`` maps config keys to column names (the keys name the setting in
    errors); ``fmt`` is csv, tsv or parquet."""
    fs, inner = fsspec.core.url_to_fs(os.fspath(path))
    if fmt == "parquet":
        # Through a handle we close: pyarrow's own read of an fsspec path leaves gcsfs's prefetch task
        # pending, which asyncio reports at exit ("Task was destroyed but it is pending!").
        with fs.open(inner, "rb") as f:
            pf, want = open_parquet(f, path, columns, optional)
            table = pf.read(columns=want)
        return _arrow_to_numpy(table, path, set(columns.values()))
    delimiter = "\t" if fmt == "tsv" else ","
    try:
        with fs.open(inner, "rb") as f:
            table = pacsv.read_csv(f, parse_options=pacsv.ParseOptions(delimiter=delimiter))
    except Exception as err:
        raise DataError(f"{str(path)!r} is not a readable {fmt.upper()} file: {err}") from err
    for key, col in columns.items():
        if col not in table.column_names:
            raise _missing(col, table.column_names, path, key)
    want = list(dict.fromkeys(list(columns.values()) + [c for c in optional if c in table.column_names]))
    return _arrow_to_numpy(table.select(want), path, set(columns.values()))


def _arrow_to_numpy(table, path, required) -> Dict[str, np.ndarray]:
    out = {}
    for name in table.column_names:
        col = table.column(name)
        if name in required and col.null_count:
            raise DataError(f"column {name!r} of {str(path)!r} has {col.null_count} null values")
        arr = col.to_numpy(zero_copy_only=False)
        if arr.dtype == object and name in required:
            arr = arr.astype(str)
        out[name] = arr
    return out
