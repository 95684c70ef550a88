#!/usr/bin/env bash
# Start (or stop, or report) the real OpenPBS server the PBS tests run against.
#
#   scripts/openpbs.sh start|stop|status      (root; CI calls `start` before the tests)
#
# The server itself is not part of this repository: it is the prebuilt OpenPBS in
# ../shared/pbs beside the checkout (a fresh CI clone has shared/ next to it), whose
# setup-openpbs.sh installs the runtime packages, unpacks /opt/pbs and starts
# pbs_server, pbs_sched, pbs_comm and a pbs_mom with 4 vnodes and ALCF-like queues.
# Set OPENPBS_SHARED=DIR to use another copy. Without one this script says where to
# get it and exits 3 (the PBS tests then skip on a laptop, and fail under CI=true).
#
# `start` is retried once: on a machine that has never run PBS, the first start
# creates PostgreSQL's datastore and has been seen to fail at `createdb` (the socket
# not there yet) while a second start, reusing what the first one created, succeeds.
# Both attempts are logged. After a successful start the PBS clients are in
# /opt/pbs/bin; put that FIRST on PATH (Debian's slurm-wlm-torque has /usr/bin/qsub).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
shared="${OPENPBS_SHARED:-$root/../shared/pbs}"
setup="$shared/setup-openpbs.sh"
action="${1:-start}"

if [[ ! -f "$setup" ]]; then
  cat >&2 <<EOF
openpbs.sh: no $setup
  The real OpenPBS for the PBS tests lives in the project's shared folder (shared/pbs,
  beside the repository checkout: <checkout>/../shared/pbs). Copy that folder there, or
  set OPENPBS_SHARED=/path/to/shared/pbs. Its README.md says how it is built.
EOF
  exit 3
fi
if [[ "$(id -u)" != 0 ]]; then
  echo "openpbs.sh: $action needs root (it runs $setup $action)" >&2
  exit 2
fi

case "$action" in
  start)
    t0=$(date +%s)
    if ! bash "$setup" start; then
      echo "openpbs.sh: first start failed; retrying once (see the header of this script)" >&2
      bash "$setup" start
    fi
    echo "openpbs.sh: OpenPBS up in $(( $(date +%s) - t0 )) s; clients in /opt/pbs/bin" >&2
    ;;
  stop|status) bash "$setup" "$action" ;;
  *) echo "openpbs.sh: $action: unknown; allowed: start, stop, status" >&2; exit 2 ;;
esac
