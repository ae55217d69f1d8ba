#!/usr/bin/env bash
# Fuzzes gpipe's parsers of a user's bytes with libFuzzer, under ASan and UBSan, in build-asan/
# (scripts/sanitize.sh builds it; docs/fuzzing.md says what each target promises).
#   scripts/fuzz.sh [SECONDS] [TARGET...]   each target for SECONDS (default 20), $(nproc) at once
#   FUZZ_SEED=N: libFuzzer's seed (default 0: a new one each run; scripts/sanitize.sh's smoke uses 1,
#   so that CI walks the same inputs each time)
# Each target starts from its seed corpus (fuzz/corpus/NAME) and the inputs of past findings
# (fuzz/regressions/NAME); what it learns stays in build-asan/fuzz/learned/NAME. A finding stops
# its target: the input is saved as build-asan/fuzz/findings/NAME-crash-..., the report printed,
# and the script ends non-zero. Keep the input as a regression: move it to fuzz/regressions/NAME/.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-20}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(fuzz_schedule_text fuzz_byte_size fuzz_checkpoint fuzz_idx fuzz_torch_save fuzz_flags)
out=build-asan/fuzz
for t in "${targets[@]}"; do
  [ -x "$out/$t" ] || { echo "fuzz: no $out/$t; build it with scripts/sanitize.sh (needs clang)" >&2; exit 2; }
done
mkdir -p "$out/findings" "$out/logs"
export ASAN_OPTIONS="detect_leaks=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
export TMPDIR="${TMPDIR:-/tmp}"

fuzz_one() {
  local t="$1" seconds="$2" out="$3"
  local inputs=("$out/learned/$t" "fuzz/corpus/$t")
  [ -d "fuzz/regressions/$t" ] && inputs+=("fuzz/regressions/$t")
  mkdir -p "$out/learned/$t"
  # libtorch allocates what a file declares (a string's length, a zip record's size) before it reads
  # it: a single allocation of any size is allowed (and a failed one throws, as in a real run), but
  # 8 GiB in use is a finding; so is an input that takes a minute.
  if ASAN_OPTIONS="allocator_may_return_null=1:$ASAN_OPTIONS" "$out/$t" -max_total_time="$seconds" -timeout=60 \
      -rss_limit_mb=8192 -malloc_limit_mb=1048576 -seed="${FUZZ_SEED:-0}" -print_final_stats=1 \
      -artifact_prefix="$out/findings/$t-" "${inputs[@]}" >"$out/logs/$t.log" 2>&1; then
    local runs cov
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$out/logs/$t.log" | grep -o '[0-9]*$' || echo "?")
    cov=$(grep -o 'cov: [0-9]*' "$out/logs/$t.log" | tail -1 | grep -o '[0-9]*' || echo "?")
    echo "fuzz: $t: ${seconds} s, $runs inputs run, $cov edges covered, no finding"
  else
    echo "fuzz: $t: FINDING (input under $out/findings/$t-*); its report:"
    grep -E -A 25 'ERROR: |runtime error|broken promise|uncaught exception|deadly signal' "$out/logs/$t.log" | head -60
    return 1
  fi
}
export -f fuzz_one
export FUZZ_SEED
printf '%s\n' "${targets[@]}" | xargs -P "$(nproc)" -I{} bash -c 'fuzz_one "$@"' _ {} "$seconds" "$out"
