#!/usr/bin/env bash
# mpi_save_test.sh: `mpirun -np 2 gpipe train --per-device-files --save FILE` whose rank 1 fails to
# save (GPIPE_TEST_FAULT=save:1:STEP): the set of per-device files is all or nothing. A failed first
# save leaves no file; a failed later save leaves the set of the save before, with its manifest,
# which resumes.
# Usage: mpi_save_test.sh PATH/TO/gpipe
set -u
gpipe="$1"
source "$(dirname "$0")/test_lib.sh"
run=(train --stages 2 --micro-batches 2 --train-samples 256 --test-samples 64 --batch-size 64 --epochs 2
     --per-device-files --save "$work/run.pt")  # 4 steps an epoch: saves at steps 4 and 8

# 1. The first save fails on rank 1: rank 0's file goes too; no manifest, no temporary file.
GPIPE_TEST_FAULT=save:1:4 timeout 120 bash "$mpirun_sh" 2 -x GPIPE_TEST_FAULT "$gpipe" "${run[@]}" \
  >/dev/null 2>"$work/err.txt"
rc=$?
left=$(cd "$work" && ls | grep -v '^err.txt$')
if [ "$rc" != 0 ] && [ "$rc" != 124 ] && [ -z "$left" ] && grep -q "made this rank's save fail" "$work/err.txt"; then
  pass "a failed first save on rank 1: exit $rc, no file left on any rank"
else fail "failed first save: exit $rc, left: $left"; tail -5 "$work/err.txt"; fi

# 2. The second save fails on rank 1: the set of step 4 stays, with its manifest, and resumes.
rm -f "$work"/run.pt*
GPIPE_TEST_FAULT=save:1:8 timeout 120 bash "$mpirun_sh" 2 -x GPIPE_TEST_FAULT "$gpipe" "${run[@]}" \
  >/dev/null 2>"$work/err.txt"
rc=$?
if [ "$rc" != 0 ] && [ "$rc" != 124 ] && grep -q "^step 4$" "$work/run.pt.manifest" 2>/dev/null &&
   [ -s "$work/run.pt.stage0-of-2" ] && [ -s "$work/run.pt.stage1-of-2" ] && [ ! -e "$work/run.pt.stage0-of-2.prev" ] &&
   [ -z "$(find "$work" -name '*.tmp.*' -print -quit)" ] &&
   timeout 120 bash "$mpirun_sh" 2 "$gpipe" train --stages 2 --micro-batches 2 --train-samples 256 --test-samples 64 \
     --batch-size 64 --epochs 2 --per-device-files --resume "$work/run.pt" >/dev/null 2>"$work/resume.txt"; then
  pass "a failed second save on rank 1: exit $rc; the set of step 4 with its manifest, which resumes"
else
  fail "failed second save: exit $rc: $(ls "$work"), manifest: $(cat "$work/run.pt.manifest" 2>/dev/null)"
  tail -5 "$work/err.txt" "$work/resume.txt" 2>/dev/null
fi

finish
