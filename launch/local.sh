#!/usr/bin/env bash
# N processes of recloss-train (or any command) on this machine, wired as N hosts.
#   launch/local.sh -n 2 -d 4 configs/base.yml steps=20 run_name=local2x4
#   launch/local.sh -n 2 -d 4 --exec -- python my_script.py
# A thin wrapper of launch/local.py (see its --help); Python: $PYTHON, else .venv/bin/python, else python3.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py=${PYTHON:-}
if [[ -z $py ]]; then
  if [[ -x $here/../.venv/bin/python ]]; then
    py=$here/../.venv/bin/python
  else
    py=python3
  fi
fi
exec "$py" "$here/local.py" "$@"
