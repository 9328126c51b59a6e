#!/usr/bin/env bash
# Run recloss-train on a Cloud TPU VM (one host or a pod slice) with plain gcloud:
# create the TPU (directly or as a queued resource), install the project on every worker,
# run the same command on all workers, collect per-worker logs, tear down.
# Every command is printed ("+ ...") before it runs; --dry-run only prints.
set -euo pipefail

PROG=launch/gcloud_tpu_vm.sh
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$here/common.sh"

GCLOUD=${GCLOUD:-gcloud}
# Where things live on every worker ($HOME is the remote user's home, expanded there).
# shellcheck disable=SC2016
{
  REMOTE_TARBALL='$HOME/recloss-src.tgz'
  REMOTE_SRC='$HOME/recloss'
  REMOTE_VENV='$HOME/recloss-venv'
  REMOTE_LOGS='$HOME/recloss_logs'
}

usage() {
  cat <<'EOF'
usage: launch/gcloud_tpu_vm.sh SUBCOMMAND --name NAME --zone ZONE [--project ID] [options] [-- ARGS ...]

subcommands
  create    create the TPU VM (gcloud compute tpus tpu-vm create), or with --queued a
            queued resource holding one node of the same name (queued-resources create)
  status    describe the TPU VM (or with --queued the queued resource)
  install   copy this source tree to every worker and install it into ~/recloss-venv
            (Python from --python-version, fetched by uv when the image lacks it)
  run       run recloss-train on every worker: ARGS are the config and key=value overrides;
            output also goes to ~/recloss_logs/<log-name>.log on each worker
  logs      copy each worker's ~/recloss_logs/<log-name>.log to OUT/<worker>.log
  stop      stop a run started with --detach (the pid it recorded on each worker)
  exec      run ARGS as a shell command on every worker
  delete    delete the TPU VM (with --queued: the queued resource and its node)

options
  --name NAME               TPU VM name (required; also the queued resource id with --queued)
  --zone ZONE               zone, e.g. us-east5-b (required)
  --project ID              project (default: gcloud config)
  --queued                  create/status/delete a queued resource instead of a TPU VM directly
  --accelerator-type TYPE   create: e.g. v6e-8, v6e-256, v5litepod-16, v5p-128 (required)
  --version VERSION         create: TPU runtime image (default from the type: v6e v2-alpha-tpuv6e,
                            v5litepod v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5, v4 tpu-ubuntu2204-base)
  --spot                    create: Spot capacity
  --valid-until-duration D  create --queued: give up if not provisioned within D (e.g. 6h)
  --source DIR              install: the source tree to copy (default: this repository)
  --python-version V        install: Python of ~/recloss-venv (default 3.11)
  --log-name NAME           run/logs/stop: log file name on the workers (default train)
  --detach                  run: start in the background and return (collect with `logs`, end with `stop`)
  --coordinator-port PORT   run: port of the jax.distributed coordinator on worker 0 (default 8482)
  --out DIR                 logs: local directory (default logs/<name>)
  --yes                     delete: do not ask for confirmation (gcloud --quiet)
  --dry-run                 print the commands, run nothing
  -h, --help                this help

example (a v6e-256 pod slice, 64 workers):
  launch/gcloud_tpu_vm.sh create  --name rl-pod --zone us-east5-b --accelerator-type v6e-256 --queued
  launch/gcloud_tpu_vm.sh install --name rl-pod --zone us-east5-b
  launch/gcloud_tpu_vm.sh run     --name rl-pod --zone us-east5-b --detach -- \
      configs/sasrec_yambda.yml base_output_directory=gs://my-bucket/runs ici_fsdp_parallelism=4
  launch/gcloud_tpu_vm.sh logs    --name rl-pod --zone us-east5-b
  launch/gcloud_tpu_vm.sh delete  --name rl-pod --zone us-east5-b --queued
Output and data may be gs:// URLs, read and written with the VM's service account (it needs
read/write access to the bucket); a bucket mounted with Cloud Storage FUSE works too.
Environment: GCLOUD names the gcloud binary (default gcloud).
EOF
}

if (($# == 0)); then
  usage >&2
  exit 2
fi
SUB=$1
shift
case $SUB in
  create | status | install | run | logs | stop | exec | delete) ;;
  -h | --help | help)
    usage
    exit 0
    ;;
  *) die "unknown subcommand '$SUB'; expected one of: create, status, install, run, logs, stop, exec, delete" ;;
esac

NAME="" ZONE="" PROJECT="" QUEUED=0 ACCEL="" VERSION="" SPOT=0 VALID_UNTIL="" SOURCE_DIR="" PYVER=3.11
LOG_NAME=train DETACH=0 COORD_PORT=8482 OUT="" YES=0 PRINT_ONLY=0
ARGS=()
while (($#)); do
  if [[ $1 == --*=* ]]; then
    set -- "${1%%=*}" "${1#*=}" "${@:2}"
  fi
  case $1 in
    --name) need_value "$1" $# && NAME=$2 && shift 2 ;;
    --zone) need_value "$1" $# && ZONE=$2 && shift 2 ;;
    --project) need_value "$1" $# && PROJECT=$2 && shift 2 ;;
    --queued) QUEUED=1 && shift ;;
    --accelerator-type) need_value "$1" $# && ACCEL=$2 && shift 2 ;;
    --version) need_value "$1" $# && VERSION=$2 && shift 2 ;;
    --spot) SPOT=1 && shift ;;
    --valid-until-duration) need_value "$1" $# && VALID_UNTIL=$2 && shift 2 ;;
    --source) need_value "$1" $# && SOURCE_DIR=$2 && shift 2 ;;
    --python-version) need_value "$1" $# && PYVER=$2 && shift 2 ;;
    --log-name) need_value "$1" $# && LOG_NAME=$2 && shift 2 ;;
    --detach) DETACH=1 && shift ;;
    --coordinator-port) need_value "$1" $# && COORD_PORT=$2 && shift 2 ;;
    --out) need_value "$1" $# && OUT=$2 && shift 2 ;;
    --yes) YES=1 && shift ;;
    --dry-run) PRINT_ONLY=1 && shift ;;
    -h | --help) usage && exit 0 ;;
    --)
      shift
      ARGS+=("$@")
      break
      ;;
    -*) die "unknown option '$1' for '$SUB' (see --help)" ;;
    *) ARGS+=("$1") && shift ;;
  esac
done

[[ -n $NAME ]] || die "--name is required"
[[ $NAME =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] ||
  die "--name '$NAME' is not a valid TPU name: lowercase letters, digits and '-', starting with a letter"
[[ -n $ZONE ]] || die "--zone is required (e.g. us-east5-b)"
[[ $LOG_NAME =~ ^[A-Za-z0-9_.-]+$ ]] || die "--log-name '$LOG_NAME' may only hold letters, digits, '_', '.', '-'"
if [[ ! $COORD_PORT =~ ^[0-9]+$ ]] || ((COORD_PORT < 1 || COORD_PORT > 65535)); then
  die "--coordinator-port must be in 1..65535, got '$COORD_PORT'"
fi
[[ $PYVER =~ ^3\.[0-9]+$ ]] || die "--python-version must look like 3.11, got '$PYVER'"
case $SUB in
  run | exec) ;;
  *) ((${#ARGS[@]} == 0)) || die "'$SUB' takes no positional arguments (got: ${ARGS[*]})" ;;
esac

where=(--zone="$ZONE")
[[ -z $PROJECT ]] || where+=(--project="$PROJECT")
quiet=()
((YES == 0)) || quiet=(--quiet)

# on_all_workers REMOTE_COMMAND [GCLOUD FLAGS...]: run a shell command on every worker at once.
on_all_workers() {
  local remote=$1
  shift
  run "$GCLOUD" compute tpus tpu-vm ssh "$NAME" "${where[@]}" --worker=all --command="$remote" "$@"
}

default_version() {
  case $1 in
    v6e-*) echo v2-alpha-tpuv6e ;;
    v5litepod-* | v5e-*) echo v2-alpha-tpuv5-lite ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v4-*) echo tpu-ubuntu2204-base ;;
    *) die "no default --version for accelerator type '$1'; pass --version (gcloud compute tpus tpu-vm versions list --zone=$ZONE)" ;;
  esac
}

# worker_ips: internal IPs of the workers, worker 0 first (from `describe`).
worker_ips() {
  run "$GCLOUD" compute tpus tpu-vm describe "$NAME" "${where[@]}" --format=json |
    python3 -c 'import json, sys; print("\n".join(e["ipAddress"] for e in json.load(sys.stdin).get("networkEndpoints", [])))'
}

case $SUB in
  create)
    [[ -n $ACCEL ]] || die "--accelerator-type is required (e.g. v6e-256)"
    [[ -n $VERSION ]] || VERSION=$(default_version "$ACCEL")
    spot=()
    ((SPOT == 0)) || spot=(--spot)
    if ((QUEUED)); then
      valid=()
      [[ -z $VALID_UNTIL ]] || valid=(--valid-until-duration="$VALID_UNTIL")
      run "$GCLOUD" compute tpus queued-resources create "$NAME" "${where[@]}" --node-id="$NAME" \
        --accelerator-type="$ACCEL" --runtime-version="$VERSION" "${spot[@]+"${spot[@]}"}" \
        "${valid[@]+"${valid[@]}"}"
      echo "# the node exists once the queued resource is ACTIVE: $PROG status --queued --name $NAME --zone $ZONE"
    else
      [[ -z $VALID_UNTIL ]] || die "--valid-until-duration needs --queued"
      run "$GCLOUD" compute tpus tpu-vm create "$NAME" "${where[@]}" --accelerator-type="$ACCEL" \
        --version="$VERSION" "${spot[@]+"${spot[@]}"}"
    fi
    ;;
  status)
    if ((QUEUED)); then
      run "$GCLOUD" compute tpus queued-resources describe "$NAME" "${where[@]}"
    else
      run "$GCLOUD" compute tpus tpu-vm describe "$NAME" "${where[@]}"
    fi
    ;;
  install)
    src=${SOURCE_DIR:-$(cd "$here/.." && pwd)}
    [[ -f $src/pyproject.toml ]] || die "--source '$src' has no pyproject.toml; point it at the recloss source tree"
    tarball="${TMPDIR:-/tmp}/recloss-src-$NAME.tgz"
    # Tracked and untracked-but-not-ignored files (no .venv, runs/, caches), or everything
    # but those when the tree is not a git checkout.
    if git -C "$src" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
      printf '+ %s | tar -C %s -czf %s --null -T -\n' >&2 \
        "$(shjoin git -C "$src" ls-files -z --cached --others --exclude-standard)" "$(shquote "$src")" \
        "$(shquote "$tarball")"
      if ((PRINT_ONLY == 0)); then
        git -C "$src" ls-files -z --cached --others --exclude-standard |
          while IFS= read -r -d '' f; do if [[ -e $src/$f ]]; then printf '%s\0' "$f"; fi; done |
          tar -C "$src" -czf "$tarball" --null -T -
      fi
    else
      run tar -C "$src" -czf "$tarball" --exclude=./.venv --exclude=./.git --exclude=./runs --exclude='*.pyc' .
    fi
    run "$GCLOUD" compute tpus tpu-vm scp "$tarball" "$NAME:recloss-src.tgz" "${where[@]}" --worker=all
    setup="set -e
rm -rf \"$REMOTE_SRC\" && mkdir -p \"$REMOTE_SRC\" && tar -xzf \"$REMOTE_TARBALL\" -C \"$REMOTE_SRC\"
export PATH=\"\$HOME/.local/bin:\$PATH\"
command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh
rm -rf \"$REMOTE_VENV\" && uv venv --python $PYVER \"$REMOTE_VENV\"
cd \"$REMOTE_SRC\" && uv pip install --python \"$REMOTE_VENV/bin/python\" '.[tpu]'
\"$REMOTE_VENV/bin/python\" -c 'import jax, recloss; print(\"installed: jax\", jax.__version__)'"
    on_all_workers "$setup"
    ;;
  run)
    if ((PRINT_ONLY)); then
      # Not run in a dry run: the IPs come from `describe`.
      show "$GCLOUD" compute tpus tpu-vm describe "$NAME" "${where[@]}" --format=json
      ips=("<worker-0-ip>" "<worker-1-ip>")
    else
      mapfile -t ips < <(worker_ips)
      ((${#ips[@]})) || die "describe listed no network endpoints for $NAME; is it READY? ($PROG status ...)"
    fi
    train="\"$REMOTE_VENV/bin/python\" -m recloss_plugins.sasrec.train"
    if ((${#ARGS[@]})); then
      train+=" $(shjoin "${ARGS[@]}")"
    fi
    # Several workers: give recloss-train a coordinator on worker 0, which makes it call
    # jax.distributed.initialize (process count and ids come from the TPU metadata).
    env_part=""
    if ((${#ips[@]} > 1)); then
      env_part="export JAX_COORDINATOR_ADDRESS=${ips[0]}:$COORD_PORT; "
    fi
    log="$REMOTE_LOGS/$LOG_NAME.log"
    prelude="set -e -o pipefail; mkdir -p \"$REMOTE_LOGS\"; cd \"$REMOTE_SRC\"; $env_part"
    if ((DETACH)); then
      remote="${prelude}nohup $train > \"$log\" 2>&1 < /dev/null & echo \$! > \"$REMOTE_LOGS/$LOG_NAME.pid\"; echo \"started pid \$! on \$(hostname), log $log\""
    else
      remote="${prelude}$train 2>&1 | tee \"$log\""
    fi
    on_all_workers "$remote"
    ;;
  logs)
    out=${OUT:-logs/$NAME}
    run mkdir -p "$out"
    # gcloud writes worker i's output to OUT/i.log.
    on_all_workers "cat \"$REMOTE_LOGS/$LOG_NAME.log\"" --output-directory="$out"
    ;;
  stop)
    on_all_workers "kill \$(cat \"$REMOTE_LOGS/$LOG_NAME.pid\") && echo \"stopped on \$(hostname)\""
    ;;
  exec)
    ((${#ARGS[@]})) || die "exec needs a command after --"
    on_all_workers "${ARGS[*]}"
    ;;
  delete)
    if ((QUEUED)); then
      run "$GCLOUD" compute tpus queued-resources delete "$NAME" "${where[@]}" --force "${quiet[@]+"${quiet[@]}"}"
    else
      run "$GCLOUD" compute tpus tpu-vm delete "$NAME" "${where[@]}" "${quiet[@]+"${quiet[@]}"}"
    fi
    ;;
esac
