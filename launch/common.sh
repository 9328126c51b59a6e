# Helpers shared by launch/xpk.sh and launch/gcloud_tpu_vm.sh (sourced, not run).
# shellcheck shell=bash

# die MESSAGE: print "NAME: error: MESSAGE" to stderr and exit 2 (a usage error).
die() {
  printf '%s: error: %s\n' "${PROG:-launch}" "$1" >&2
  exit 2
}

# shquote WORD: WORD quoted for a POSIX shell (unchanged when it needs no quotes).
shquote() {
  local s=$1
  if [[ -n $s && $s =~ ^[A-Za-z0-9_./:=@%+,^-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/\'\\\'\'}"
  fi
}

# shjoin WORD...: the words quoted and joined by spaces, one shell command line.
shjoin() {
  local out="" word
  for word in "$@"; do
    out+="${out:+ }$(shquote "$word")"
  done
  printf '%s' "$out"
}

# show CMD...: print "+ CMD" (quoted) to stderr, like `set -x`, so stdout stays the commands' own.
show() {
  printf '+ %s\n' "$(shjoin "$@")" >&2
}

# run CMD...: show it, then run it unless PRINT_ONLY=1.
run() {
  show "$@"
  if [[ ${PRINT_ONLY:-0} == 1 ]]; then
    return 0
  fi
  "$@"
}

# need_value FLAG NEXT_ARG_COUNT: die unless FLAG has a value after it.
need_value() {
  if (($2 < 2)); then
    die "$1 needs a value"
  fi
}
