#!/bin/bash
# Seed 003's `./train_distributed.sh N ARGS`: Crowd-BT on N ranks of this machine.
#   jobs/crowdbt_local.sh 4 --epochs 20 --batch-size 16
#   jobs/crowdbt_local.sh 2 --backbone efficientnet_b3 --input-size 384 --batch-size 32 --lr 2e-4 --data-dir DIR
# A thin script over `hpc run` (which renders jobs/crowdbt_cpu.yaml with --ppn N and runs
# it: torchrun --standalone); ARGS are crowdbt's flags, passed on as they are ("$@"), so
# they reach the job only as quoted words. Paths in ARGS are taken from where you run it.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 N [crowdbt flags...]   (N: ranks on this machine, a whole number >= 1)" >&2
  exit 2
fi
n=$1
shift
case $n in
  '' | *[!0-9]* | 0*)
    echo "$0: device count '$n' is not allowed; allowed: a whole number >= 1, first" >&2
    exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root/src:$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m hpc run "$root/jobs/crowdbt_cpu.yaml" --ppn "$n" -- \
  python -m ddp crowdbt --config "$root/configs/crowdbt.yaml" "$@"
