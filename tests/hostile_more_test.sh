#!/usr/bin/env bash
# hostile_more_test.sh: more of what careless and hostile users did, each case ending with a clear
# error (or a clear report) before any work: a batch larger than the data, a warm-up longer than
# the run, a diverged model, a trace named x.SVG, gpipe plan's progress, gpipe bench's --results '',
# generation into a file; under mpirun (with MPI as the second argument, 1): a usage error said
# once, and a per-device set that lacks a file.
# Usage: hostile_more_test.sh PATH/TO/gpipe [MPI: 0 or 1]
set -u
gpipe="$1"
mpi="${2:-0}"
source "$(dirname "$0")/test_lib.sh"
cd "$work" || exit 1
tiny=(--train-samples 64 --test-samples 64)

# run NAME STATUS PATTERN ARGS...: `gpipe ARGS` exits with STATUS (within 60 s) and its standard
# error matches PATTERN (grep -E); no epoch was reported unless STATUS is 0.
run() {
  local name="$1" status="$2" pattern="$3"
  shift 3
  timeout 60 "$gpipe" "$@" >"$work/out.txt" 2>"$work/err.txt"
  local got=$?
  if [ "$got" -ne "$status" ]; then fail "$name: exit $got, not $status: $(head -c 400 "$work/err.txt")"; return 1; fi
  if ! grep -Eq -- "$pattern" "$work/err.txt"; then fail "$name: no /$pattern/ in: $(head -c 400 "$work/err.txt")"; return 1; fi
  if [ "$status" -ne 0 ] && grep -q "^epoch" "$work/out.txt"; then fail "$name: trained before the error"; return 1; fi
  pass "$name: $(grep -E -m1 -- "$pattern" "$work/err.txt" | head -c 160)"
}

# A batch larger than the training data: refused with both numbers and the fix, before any step.
run "--batch-size above the training samples" 2 \
  "--batch-size 100000 is more than the 64 training samples the data holds; .* give --batch-size 64 or less" \
  train "${tiny[@]}" --batch-size 100000

# A warm-up longer than the run would never reach --lr: refused with the run's steps, before auto's
# profile (seconds of work for a setting read from the flags).
run "--warmup-steps longer than the run" 2 \
  "the warm-up of 1000000 steps \(--warmup-steps\) is longer than the run's 2 steps.*give at most 2 warm-up steps" \
  train --train-samples 256 --test-samples 64 --batch-size 64 --steps 2 --warmup-steps 1000000 &&
  if grep -q "profiling" "$work/out.txt"; then fail "--warmup-steps refused only after the profile"; fi

# A model diverged to a NaN test loss with finite parameters (one step at --lr 1e30): exit 1, the
# cause named, and no checkpoint written for it.
run "a diverged model's NaN test loss" 1 \
  "the test loss is (NaN|infinite) after epoch 1 .*the learning rate \(--lr 1e\+30\) is too high.*nothing was saved" \
  train "${tiny[@]}" --batch-size 64 --epochs 1 --lr 1e30 --save diverged.pt
if [ -e diverged.pt ]; then fail "a diverged model was saved"; else pass "a diverged model is not saved"; fi

# The trace's format from its suffix in any case: x.SVG is the chart.
if timeout 60 "$gpipe" train "${tiny[@]}" --batch-size 32 --steps 1 --trace step.SVG >/dev/null 2>"$work/err.txt" &&
   head -c 200 step.SVG | grep -q "<svg"; then
  pass "--trace step.SVG writes the SVG chart"
else
  fail "--trace step.SVG: $(head -c 100 step.SVG 2>/dev/null) $(head -c 300 "$work/err.txt")"
fi

# gpipe plan's progress is of the search alone, and one that was shown ends at 100%.
if timeout 60 "$gpipe" plan --workload resnet --devices 4 --batch 64 >/dev/null 2>"$work/plan.err"; then
  last=$(grep "pairs simulated" "$work/plan.err" | tail -1)
  if [ -z "$last" ] || echo "$last" | grep -q "gpipe plan: 100% of"; then
    pass "gpipe plan's progress: ${last:-none shown (the search took under 2 s)}"
  else
    fail "gpipe plan's last progress line is not 100%: $last"
  fi
else
  fail "gpipe plan --workload resnet: $(head -c 300 "$work/plan.err")"
fi

# gpipe bench --results '': no results file, the table alone; every option checked before the header.
if timeout 60 "$gpipe" bench --results '' --workload tiny --stages 2 --micro-batches 2 --steps 1 --warmup 3 \
     --checkpoint never --schedule gpipe >bench.txt 2>"$work/bench.err" &&
   grep -q "^workload" bench.txt && grep -q "^tiny" bench.txt && ! grep -q "results written" "$work/bench.err"; then
  pass "gpipe bench --results '': the table, no results file"
else
  fail "gpipe bench --results '': $(head -c 300 bench.txt) $(head -c 300 "$work/bench.err")"
fi
if timeout 60 "$gpipe" bench --results '' --workload tiny --stages 2 --micro-batches 100000 >bench.txt 2>"$work/bench.err"; then
  fail "gpipe bench --micro-batches 100000 of a batch of fewer rows was accepted"
elif [ -s bench.txt ]; then
  fail "gpipe bench printed before its error: $(head -c 200 bench.txt)"
else
  pass "gpipe bench: an option refused before anything is printed: $(head -c 160 "$work/bench.err")"
fi

# Generation into a file shows how far it is on standard error.
if timeout 120 "$gpipe" train --model gpt --train-samples 64 --test-samples 16 --batch-size 64 --steps 1 \
     --generate 2000 >gen.txt 2>"$work/gen.err" &&
   grep -Eq "gpipe: generated [0-9]+ of 2000 bytes in" "$work/gen.err" &&
   grep -q "gpipe: generated 2000 of 2000 bytes" "$work/gen.err"; then
  pass "--generate into a file: $(grep -m1 "gpipe: generated" "$work/gen.err")"
else
  fail "--generate into a file showed no progress: $(tail -c 300 "$work/gen.err")"
fi

if [ "$mpi" = 1 ] && command -v mpirun >/dev/null; then
  # A usage error under mpirun is said once, with no line of the launcher's SIGTERM after it.
  timeout 60 bash "$mpirun_sh" 2 "$gpipe" train --model gpt --resume missing.pt --epochs 0 --generate 10 \
    >/dev/null 2>"$work/mpi.err"
  said=$(grep -c "generate samples byte by byte" "$work/mpi.err")
  if [ "$said" = 1 ] && ! grep -q "ended by SIGTERM" "$work/mpi.err"; then
    pass "a usage error under mpirun: said once, no signal line"
  else
    fail "a usage error under mpirun: $(head -c 600 "$work/mpi.err")"
  fi
  # A per-device set that lacks device 0's file: the message names the file and the real fix.
  if timeout 120 bash "$mpirun_sh" 2 "$gpipe" train "${tiny[@]}" --batch-size 32 --epochs 1 --stages 2 \
       --save set.pt --per-device-files >/dev/null 2>"$work/save.err"; then
    rm -f set.pt.stage0-of-2
    timeout 60 bash "$mpirun_sh" 2 "$gpipe" train "${tiny[@]}" --batch-size 32 --epochs 2 --stages 2 \
      --resume set.pt --per-device-files >/dev/null 2>"$work/resume.err"
    if grep -q "no such file: set.pt.stage0-of-2 (the set of 2 per-device files of set.pt lacks this device's file" \
         "$work/resume.err" && ! grep -q "resume with the K\|resume with --stages" "$work/resume.err"; then
      pass "a per-device set without device 0's file: named, and no --stages advice"
    else
      fail "a per-device set without device 0's file: $(head -c 600 "$work/resume.err")"
    fi
  else
    fail "saving per-device files under mpirun: $(head -c 300 "$work/save.err")"
  fi
fi

finish
