#!/usr/bin/env bash
# signal_more_test.sh: the signals beyond SIGINT and SIGTERM, and a file-size limit, in `gpipe train
# --save`: SIGHUP (a closed terminal, a dropped ssh) stops and saves as SIGTERM does; a second,
# different signal ends the run at once and says which file is whole at which step; SIGQUIT ends it at
# once, no FILE.tmp.* left; `ulimit -f` below the file's size is a clean error, not death by SIGXFSZ.
# Usage: signal_more_test.sh PATH/TO/gpipe
set -u
ulimit -c 0  # SIGQUIT's default action dumps core: none here
gpipe="$1"
work=$(mktemp -d)
source "$(dirname "$0")/signal_lib.sh"
run=(train --schedule task --train-samples 640 --test-samples 100 --batch-size 64 --epochs 3)

start() {  # start ARGS...: the run in the background, its standard error in $work/err.txt
  rm -f "$work/err.txt"
  "$gpipe" "${run[@]}" "$@" >/dev/null 2>"$work/err.txt" &
  pid=$!
  pids+=("$pid")
}

# 1. SIGHUP at a step: stopped at a step boundary and saved, as SIGTERM (exit 128 + 1).
rm -f "$work/run.pt"
start --save "$work/run.pt"
if wait_for "$work/err.txt" "epoch 1/3 step 3/10" "$pid"; then
  kill -HUP "$pid"; wait "$pid"; rc=$?
  if [ "$rc" = 129 ] && grep -q "stopped by .* at step" "$work/err.txt" && [ -s "$work/run.pt" ] && no_temporaries &&
     "$gpipe" "${run[@]}" --resume "$work/run.pt" --steps 1 >/dev/null 2>&1; then
    pass "SIGHUP: stopped at a step boundary, saved, resumable (exit $rc)"
  else fail "SIGHUP: exit $rc"; cat "$work/err.txt"; fi
else fail "SIGHUP: no step line"; fi

# 2. SIGINT and SIGTERM together: the second ends the run at once, saying which save is whole and
# at which step (or the first has already stopped it, saved).
rm -f "$work/run.pt"
start --save "$work/run.pt" --save-every 1
if wait_for "$work/err.txt" "epoch 1/3 step 4/10" "$pid"; then
  kill -INT "$pid"; kill -TERM "$pid"; wait "$pid"; rc=$?
  line=$(grep "a second signal" "$work/err.txt")
  # The kernel may deliver the two in either order: the second one ends the run, named.
  if { [ "$rc" = 143 ] && echo "$line" | grep -q "gpipe: ended by SIGTERM, a second signal.*the last save is whole: $work/run.pt (step [0-9]*)"; } ||
     { [ "$rc" = 130 ] && echo "$line" | grep -q "gpipe: ended by SIGINT, a second signal.*the last save is whole: $work/run.pt (step [0-9]*)"; } ||
     { [ "$rc" = 130 ] && grep -q "stopped by SIGINT" "$work/err.txt"; }; then
    pass "a second signal: exit $rc, '${line:-the first one stopped the run before it came}'"
  else fail "a second signal: exit $rc"; cat "$work/err.txt"; fi
  no_temporaries || fail "a second signal left a temporary file: $(ls "$work")"
else fail "second signal: no step line"; fi

# 3. SIGQUIT at random moments of a run saving every step: ended at once, no temporary file left.
for trial in 1 2 3; do
  rm -f "$work/run.pt"
  start --save "$work/run.pt" --save-every 1
  if wait_for "$work/err.txt" "epoch 1/3 step $((trial + 1))/10" "$pid"; then
    sleep "0.0$((RANDOM % 10))"
    kill -QUIT "$pid"; wait "$pid"; rc=$?
    if [ "$rc" -gt 128 ] && no_temporaries && grep -q "gpipe: ended by SIGQUIT" "$work/err.txt"; then
      pass "SIGQUIT (trial $trial): exit $rc, no temporary file, '$(grep "ended by SIGQUIT" "$work/err.txt")'"
    else fail "SIGQUIT (trial $trial): exit $rc, $(ls "$work")"; cat "$work/err.txt"; fi
  else fail "SIGQUIT: no step line"; fi
done

# 4. A file-size limit below the checkpoint's size: the same clean error as a full disk.
rm -f "$work/run.pt"
(ulimit -f 8; "$gpipe" "${run[@]}" --steps 2 --save "$work/run.pt" >/dev/null 2>"$work/err.txt")
rc=$?
if [ "$rc" != 0 ] && [ "$rc" != 153 ] && grep -q "File too large" "$work/err.txt" && no_temporaries; then
  pass "ulimit -f 8: exit $rc, '$(grep -o "File too large.*" "$work/err.txt" | head -1)'"
else fail "ulimit -f: exit $rc, $(ls "$work")"; cat "$work/err.txt"; fi

# 5. Under nohup (SIGHUP ignored from the start) a hang-up changes nothing: the run trains to its end.
rm -f "$work/err.txt"
( trap '' HUP; exec "$gpipe" "${run[@]}" >/dev/null 2>"$work/err.txt" ) &
pid=$!
pids+=("$pid")
if wait_for "$work/err.txt" "epoch 1/3 step 3/10" "$pid"; then
  kill -HUP "$pid"; wait "$pid"; rc=$?
  if [ "$rc" = 0 ] && ! grep -q "SIGHUP" "$work/err.txt"; then pass "SIGHUP ignored from the start (nohup): trained to the end"
  else fail "nohup: exit $rc"; cat "$work/err.txt"; fi
else fail "nohup: no step line"; fi

echo "$failures failure(s)"
[ "$failures" -eq 0 ]
