#!/usr/bin/env bash
# Run recloss-train on a GKE TPU cluster as an xpk workload; list, watch and delete it.
# Every command is printed ("+ ...") before it runs. See launch/README.md for the whole recipe.
set -euo pipefail

PROG=launch/xpk.sh
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$here/common.sh"

XPK=${XPK:-xpk}
KUBECTL=${KUBECTL:-kubectl}

usage() {
  cat <<'EOF'
usage: launch/xpk.sh SUBCOMMAND [options] [-- CONFIG.yml key=value ...]

subcommands
  create   submit recloss-train as a workload (xpk workload create)
  list     show workloads, or one with --workload (xpk workload list)
  watch    status, then follow the logs of process 0 (xpk workload list; kubectl logs -f)
  delete   delete the workload (xpk workload delete)

options
  --cluster NAME          GKE cluster made by `xpk cluster create` (required)
  --workload NAME         workload name: [a-z]([-a-z0-9]*[a-z0-9])?, at most 40 characters
                          (required by create, watch and delete)
  --project ID            GCP project (default: gcloud config)
  --zone ZONE             zone of the cluster (default: gcloud config)
  --tpu-type TYPE         create: slice type, e.g. v6e-256 (required)
  --num-slices N          create: slices, joined over DCN (default 1; the dcn_* keys split work across them)
  --docker-image IMAGE    create: image with recloss installed, e.g. gcr.io/PROJECT/recloss:latest (required)
  --priority P            create: very-low | low | medium | high | very-high (xpk default: medium)
  --max-restarts N        create: restarts of the JobSet on failure (xpk default: 0);
                          a restarted run resumes from the run_name's latest checkpoint
  --env KEY=VALUE         create: environment variable in the container (repeatable)
  --train-cmd CMD         create: the training program (default: recloss-train)
  --xpk-flag FLAG         create: one more flag passed to xpk as is, e.g. --xpk-flag=--spot (repeatable)
  --all-workers           watch: follow every pod, not only process 0 (only process 0 logs progress)
  --container NAME        watch: container name (xpk's --docker-name; default jax-tpu)
  --yes                   delete: do not ask (xpk --force)
  --dry-run               passed to xpk (it prints the commands it would run); kubectl steps are only printed
  --print-only            print the commands without running anything
  -h, --help              this help

Everything after -- (or any argument not starting with --) goes to the training program:
  launch/xpk.sh create --cluster tpu-cluster --workload sasrec-1 --tpu-type v6e-256 \
      --docker-image gcr.io/my-project/recloss:latest --project my-project --zone us-east5-b \
      -- configs/sasrec_yambda.yml base_output_directory=gs://my-bucket/runs steps=1000
Output and data may be gs:// URLs (read and written directly, with the node pool's service
account); a Cloud Storage FUSE mount (e.g. /gcs/runs) works too but is not needed.
Environment: XPK and KUBECTL name the binaries (default xpk, kubectl).
EOF
}

if (($# == 0)); then
  usage >&2
  exit 2
fi
SUB=$1
shift
case $SUB in
  create | list | watch | delete) ;;
  -h | --help | help)
    usage
    exit 0
    ;;
  *) die "unknown subcommand '$SUB'; expected one of: create, list, watch, delete" ;;
esac

CLUSTER="" WORKLOAD="" PROJECT="" ZONE="" TPU_TYPE="" NUM_SLICES=1 IMAGE="" PRIORITY="" MAX_RESTARTS=""
TRAIN_CMD=recloss-train CONTAINER=jax-tpu ALL_WORKERS=0 YES=0 DRY_RUN=0 PRINT_ONLY=0
ENVS=() XPK_FLAGS=() TRAIN_ARGS=()
while (($#)); do
  if [[ $1 == --*=* ]]; then
    set -- "${1%%=*}" "${1#*=}" "${@:2}"
  fi
  case $1 in
    --cluster) need_value "$1" $# && CLUSTER=$2 && shift 2 ;;
    --workload) need_value "$1" $# && WORKLOAD=$2 && shift 2 ;;
    --project) need_value "$1" $# && PROJECT=$2 && shift 2 ;;
    --zone) need_value "$1" $# && ZONE=$2 && shift 2 ;;
    --tpu-type) need_value "$1" $# && TPU_TYPE=$2 && shift 2 ;;
    --num-slices) need_value "$1" $# && NUM_SLICES=$2 && shift 2 ;;
    --docker-image) need_value "$1" $# && IMAGE=$2 && shift 2 ;;
    --priority) need_value "$1" $# && PRIORITY=$2 && shift 2 ;;
    --max-restarts) need_value "$1" $# && MAX_RESTARTS=$2 && shift 2 ;;
    --env) need_value "$1" $# && ENVS+=("$2") && shift 2 ;;
    --train-cmd) need_value "$1" $# && TRAIN_CMD=$2 && shift 2 ;;
    --xpk-flag) need_value "$1" $# && XPK_FLAGS+=("$2") && shift 2 ;;
    --container) need_value "$1" $# && CONTAINER=$2 && shift 2 ;;
    --all-workers) ALL_WORKERS=1 && shift ;;
    --yes) YES=1 && shift ;;
    --dry-run) DRY_RUN=1 && shift ;;
    --print-only) PRINT_ONLY=1 && shift ;;
    -h | --help) usage && exit 0 ;;
    --)
      shift
      TRAIN_ARGS+=("$@")
      break
      ;;
    -*) die "unknown option '$1' for '$SUB' (see --help)" ;;
    *) TRAIN_ARGS+=("$1") && shift ;;
  esac
done

[[ -n $CLUSTER ]] || die "--cluster is required"
if [[ -n $WORKLOAD ]]; then
  if [[ ! $WORKLOAD =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ || ${#WORKLOAD} -gt 40 ]]; then
    die "--workload '$WORKLOAD' is not a valid xpk name: lowercase letters, digits and '-', starting with a letter, not ending with '-', at most 40 characters"
  fi
elif [[ $SUB != list ]]; then
  die "--workload is required for '$SUB'"
fi
if [[ $SUB != create ]]; then
  if ((${#TRAIN_ARGS[@]})) || [[ -n $TPU_TYPE || -n $IMAGE || ${#ENVS[@]} -gt 0 || ${#XPK_FLAGS[@]} -gt 0 ]]; then
    die "training arguments, --tpu-type, --docker-image, --env and --xpk-flag only apply to 'create'"
  fi
fi

# Flags every xpk subcommand shares.
common=(--cluster="$CLUSTER")
[[ -z $PROJECT ]] || common+=(--project="$PROJECT")
[[ -z $ZONE ]] || common+=(--zone="$ZONE")
((DRY_RUN == 0)) || common+=(--dry-run)

case $SUB in
  create)
    [[ -n $TPU_TYPE ]] || die "--tpu-type is required (e.g. v6e-256)"
    [[ -n $IMAGE ]] || die "--docker-image is required (build and push it as launch/README.md shows)"
    [[ $NUM_SLICES =~ ^[1-9][0-9]*$ ]] || die "--num-slices must be an integer >= 1, got '$NUM_SLICES'"
    if [[ -n $MAX_RESTARTS && ! $MAX_RESTARTS =~ ^[0-9]+$ ]]; then
      die "--max-restarts must be an integer >= 0, got '$MAX_RESTARTS'"
    fi
    case ${PRIORITY:-medium} in
      very-low | low | medium | high | very-high) ;;
      *) die "--priority must be one of very-low, low, medium, high, very-high; got '$PRIORITY'" ;;
    esac
    for kv in "${ENVS[@]+"${ENVS[@]}"}"; do
      [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env expects KEY=VALUE, got '$kv'"
    done
    # xpk runs this line with bash -c inside the container; the arguments are quoted for it.
    command_line=$TRAIN_CMD
    if ((${#TRAIN_ARGS[@]})); then
      command_line+=" $(shjoin "${TRAIN_ARGS[@]}")"
    fi
    args=(workload create "${common[@]}" --workload="$WORKLOAD" --tpu-type="$TPU_TYPE"
      --num-slices="$NUM_SLICES" --docker-image="$IMAGE" --command="$command_line")
    [[ -z $PRIORITY ]] || args+=(--priority="$PRIORITY")
    [[ -z $MAX_RESTARTS ]] || args+=(--max-restarts="$MAX_RESTARTS")
    for kv in "${ENVS[@]+"${ENVS[@]}"}"; do
      args+=(--env="$kv")
    done
    run "$XPK" "${args[@]}" "${XPK_FLAGS[@]+"${XPK_FLAGS[@]}"}"
    ;;
  list)
    args=(workload list "${common[@]}")
    [[ -z $WORKLOAD ]] || args+=(--filter-by-job="$WORKLOAD")
    run "$XPK" "${args[@]}"
    ;;
  delete)
    args=(workload delete "${common[@]}" --workload="$WORKLOAD")
    ((YES == 0)) || args+=(--force)
    run "$XPK" "${args[@]}"
    ;;
  watch)
    # `xpk workload list` also points kubectl at the cluster (it fetches its credentials).
    run "$XPK" workload list "${common[@]}" --filter-by-job="$WORKLOAD"
    ((DRY_RUN == 0)) || PRINT_ONLY=1
    # JobSet labels every pod with its jobset (= workload) name; process 0 is job 0, completion index 0.
    selector="jobset.sigs.k8s.io/jobset-name=$WORKLOAD"
    if ((ALL_WORKERS == 0)); then
      selector+=",jobset.sigs.k8s.io/job-index=0,batch.kubernetes.io/job-completion-index=0"
    fi
    phase_cmd=("$KUBECTL" get pods -l "$selector" -o "jsonpath={.items[*].status.phase}")
    printf '+ %s   # every 15 s until a pod has started\n' "$(shjoin "${phase_cmd[@]}")" >&2
    if ((PRINT_ONLY == 0)); then
      while :; do
        phases=$("${phase_cmd[@]}")
        if [[ $phases == *Running* || $phases == *Succeeded* || $phases == *Failed* ]]; then
          break
        fi
        printf 'waiting for pods of %s (phases: %s) ...\n' "$WORKLOAD" "${phases:-none yet}"
        sleep 15
      done
    fi
    run "$KUBECTL" logs -f --prefix --tail=-1 --max-log-requests=1024 -c "$CONTAINER" -l "$selector"
    ;;
esac
