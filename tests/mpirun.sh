#!/usr/bin/env bash
# Runs a command under mpirun on this machine (loopback): tests/mpirun.sh NP COMMAND [ARGS...]
# --oversubscribe lets NP exceed the cores; --allow-run-as-root is needed when CI runs as root.
set -euo pipefail
np="$1"
shift
flags=(--oversubscribe --bind-to none)
[ "$(id -u)" -ne 0 ] || flags+=(--allow-run-as-root)
exec mpirun "${flags[@]}" -np "$np" "$@"
