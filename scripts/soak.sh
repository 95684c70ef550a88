#!/usr/bin/env bash
# The README's two commands (`make run`, `make test`), RUNS times in a row on one commit,
# each in a fresh clone and a new venv (the path a new user takes), while two busy loops
# keep both cores busy: the check that the suite has no flaky test under contention.
#
#   scripts/soak.sh [RUNS] [COMMIT]     (default: 5 runs of HEAD; root, for OpenPBS)
#
# Each clone goes beside this checkout (<checkout>/../soak-N), so ../shared/pbs resolves
# as it does in CI; its venv is <checkout>/../soak-N.venv. The real OpenPBS server is
# started first (scripts/openpbs.sh start), as .ci/run does. Logs and one summary line per
# run go to $SOAK_DIR (default /tmp/hpc-ddp-soak). The script stops at the first failed
# run and exits 1; it exits 0 when all RUNS passed. On 2 cores a run took 72 min (measured).
set -uo pipefail

runs="${1:-5}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
logs="${SOAK_DIR:-/tmp/hpc-ddp-soak}"
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "soak.sh: RUNS must be a whole number >= 1, not '$runs'" >&2; exit 2; }
commit="$(git -C "$here" rev-parse -q --verify "${2:-HEAD}^{commit}")" ||
  { echo "soak.sh: '${2:-HEAD}' is not a commit of $here" >&2; exit 2; }
mkdir -p "$logs"
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin" CI=true
"$here/scripts/openpbs.sh" start || exit 1

busy=()
stop_busy() { [[ ${#busy[@]} -gt 0 ]] && kill "${busy[@]}" 2>/dev/null; busy=(); }
trap stop_busy EXIT

for n in $(seq 1 "$runs"); do
  dir="$here/../soak-$n"
  rm -rf "$dir" "$dir.venv"
  git clone -q "$here" "$dir" && git -C "$dir" checkout -q "$commit" || exit 1
  python3 -m venv "$dir.venv" || exit 1
  (while :; do :; done) & busy+=($!)
  (while :; do :; done) & busy+=($!)
  t0=$(date +%s)
  (cd "$dir" && . "$dir.venv/bin/activate" && make run) >"$logs/run$n.log" 2>&1
  run_rc=$?
  t1=$(date +%s)
  (cd "$dir" && . "$dir.venv/bin/activate" && make test) >"$logs/test$n.log" 2>&1
  test_rc=$?
  t2=$(date +%s)
  stop_busy
  line="run $n of $runs, ${commit:0:7}: make run rc=$run_rc ($((t1 - t0)) s), make test rc=$test_rc ($((t2 - t1)) s): $(tail -n 1 "$logs/test$n.log")"
  echo "$line" | tee -a "$logs/summary.txt"
  [[ $run_rc == 0 && $test_rc == 0 ]] || exit 1
done
