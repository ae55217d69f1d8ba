# parts_lib.sh: a test script in parts that CTest runs as separate tests (SCRIPT.PART), so that
# `ctest -j` spreads a long script over the cores and no test runs long. Sourced by the script, which
# marks each part with a block
#   if part NAME; then ... fi
# and ends with `parts_end || failures=$((failures + 1))`. GPIPE_TEST_PART=NAME runs that part alone
# (what CTest does); unset or empty, every part runs in order (what a person running the script does).
# tests/CMakeLists.txt reads the part names from the `if part NAME; then` lines: a new part is a new
# test without an entry there; `if part NAME; then  # cost SECONDS` gives its CTest COST (about its
# seconds alone on 2 quiet cores), by which CTest starts the longest first. Each part makes what it needs itself: it runs alone.

parts_seen=()
part_started=

# part NAME: whether NAME runs (it is the part asked for, or none was); says which part starts.
part() {
  parts_seen+=("$1")
  if [ -n "${GPIPE_TEST_PART:-}" ] && [ "$GPIPE_TEST_PART" != "$1" ]; then return 1; fi
  echo "== part $1 (at ${SECONDS} s)"
  part_started=1
}

# After the last part: a part asked for that the script lacks (a misspelt name) fails, not passes.
parts_end() {
  if [ -z "$part_started" ]; then
    echo "FAILED: no part '${GPIPE_TEST_PART:-}' in $0; its parts: ${parts_seen[*]}"
    return 1
  fi
  # The time, and the processor time its commands used (user and system, from `times`): on a
  # loaded machine the first grows, the second hardly.
  local cpu
  cpu=$(mktemp)
  times >"$cpu"  # here, not in a subshell: its second line is this shell's children
  echo "== done (at ${SECONDS} s; processor time of its commands, user and system: $(tail -1 "$cpu"))"
  rm -f "$cpu"
}
