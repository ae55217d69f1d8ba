# test_lib.sh: what cli_test.sh, hostile_input_test.sh, hostile_more_test.sh, mpi_cli_test.sh and
# mpi_save_test.sh share; sourced first thing (after `set -u`): the folder of the tests and
# tests/mpirun.sh, the pass and fail counts, a scratch folder $work removed when the script ends,
# and the closing line. (The signal scripts have tests/signal_lib.sh, which also kills their
# background runs.)
tests_dir="$(cd "$(dirname "$0")" && pwd)"
mpirun_sh="$tests_dir/mpirun.sh"
failures=0
passes=0
pass() { echo "ok: $1"; passes=$((passes + 1)); }
fail() { echo "FAILED: $1"; failures=$((failures + 1)); }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The last line of a script: the counts, and its exit status (0 only without a failure).
finish() {
  echo "$passes passed, $failures failed"
  [ "$failures" -eq 0 ]
}
