# signal_lib.sh: what signal_test.sh, signal_more_test.sh and mpi_signal_test.sh share; sourced after
# $work is set: the pass and fail counts, and the runs started in the background (pids), killed with
# $work removed when the script ends.
failures=0
pass() { echo "ok: $1"; }
fail() { echo "FAILED: $1"; failures=$((failures + 1)); }
pids=()
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done; rm -rf "$work"' EXIT

# The parameter checksum of a --json summary, exactly as written.
checksum() { /usr/bin/python3 -c 'import json,sys; print(repr(json.load(open(sys.argv[1]))["parameter_checksum"]))' "$1"; }

# wait_for FILE PATTERN PID: waits until FILE has a line matching PATTERN (the program's own output)
# while PID runs; fails when PID has ended or after 120 s.
wait_for() {
  local deadline=$((SECONDS + 120))
  until grep -q -- "$2" "$1" 2>/dev/null; do
    kill -0 "$3" 2>/dev/null || return 1
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.005
  done
}

# wait_bounded PID SECONDS: waits for PID (a child of this shell) to end and returns its exit status;
# a PID still running after SECONDS (hung: the runs here end in seconds) is killed, and the status
# is 124, as timeout's.
wait_bounded() {
  if ! timeout "$2" tail --pid="$1" -s 0.1 -f /dev/null; then
    kill -9 "$1" 2>/dev/null
    wait "$1" 2>/dev/null
    return 124
  fi
  wait "$1"
}

# Whether no FILE.tmp.* is left under $work.
no_temporaries() { [ -z "$(find "$work" -name '*.tmp.*' -print -quit)" ]; }
