#!/bin/bash
# Seed 000's `./run_ddp.sh N True|False`: embedding distillation on N ranks of this machine,
# with (True) or without (False: MRL mode) the projection layer.
#   jobs/distill_local.sh 8 True
#   jobs/distill_local.sh 8 False --batch_size=32
# A thin script over `hpc run` (which renders jobs/distill_cpu.yaml with --ppn N and runs
# it: torchrun --standalone); further ARGS are distill's flags, passed on as they are
# ("$@"), so they reach the job only as quoted words. The second word may be left out
# (the config's use_projection then holds).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 N [True|False] [distill flags...]   (N: ranks on this machine, >= 1)" >&2
  exit 2
fi
n=$1
shift
case $n in
  '' | *[!0-9]* | 0*)
    echo "$0: device count '$n' is not allowed; allowed: a whole number >= 1, first" >&2
    exit 2 ;;
esac
projection=()
if [ $# -ge 1 ] && [ "${1#-}" = "$1" ]; then
  case $1 in
    [Tt]rue | [Ff]alse) projection=("--use_projection=$1") ;;
    *)
      echo "$0: use_projection '$1' is not allowed; allowed: True or False, after N" >&2
      exit 2 ;;
  esac
  shift
fi
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root/src:$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m hpc run "$root/jobs/distill_cpu.yaml" --ppn "$n" -- \
  python -m ddp distill --config "$root/configs/distill.yaml" ${projection[@]+"${projection[@]}"} "$@"
