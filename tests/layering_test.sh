#!/usr/bin/env bash
# layering_test.sh: the folders of src/ form a ladder (docs/architecture.md, "The ladder"): each file
# includes only headers of its own folder or of folders below it, so no two folders depend on each
# other, directly or through a third. Reads every #include "..." of src/ and include/gpipe/: an
# internal header ("runtime/group.h") belongs to its folder, a public one ("gpipe/plan.h") to the
# folder that implements it (the table below, checked against the .cc files that include their own
# header first). Fails naming each file and the include that climbs the ladder.
#
#   tests/layering_test.sh [SOURCE_DIR]
set -euo pipefail
root="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$root"

# The ladder, lowest first.
ladder=(common schedule device plan transport runtime model cost choose train tasks)
declare -A rung
for i in "${!ladder[@]}"; do rung[${ladder[$i]}]=$i; done
rung[umbrella]=${#ladder[@]}  # gpipe.h, all of them: for users, never for src/

# Each public header and the folder that implements it (header-only ones: the folder they belong to).
declare -A home=(
  [check]=common [environment]=common [command_line]=common [digest]=common [io]=common [progress]=common [stop]=common [tensors]=common
  [schedule]=schedule
  [blas]=device [device]=device [memory]=device [trace]=device
  [layers]=plan [partition]=plan [pipeline_config]=plan [plan]=plan [skip_connections]=plan
  [transport]=transport [backend]=transport [mpi_backend]=transport [c10d_backend]=transport [job]=transport
  [executor]=runtime [microbatch]=runtime [pipeline]=runtime [skip]=runtime [stage]=runtime [mpi]=runtime
  [models]=model [script_model]=model [workloads]=model
  [cost_model]=cost [planner]=cost
  [calibrate]=choose [choose]=choose
  [data]=train [loss_scale]=train [snapshot]=train [train]=train
  [tasks]=tasks [results]=tasks [settings]=tasks
  [gpipe]=umbrella
)

failures=0
fail() {
  echo "layering: $*" >&2
  failures=$((failures + 1))
}

for header in include/gpipe/*.h; do
  name=$(basename "$header" .h)
  [[ -n "${home[$name]:-}" ]] || fail "$header is in no folder of the ladder; add it to the table in tests/layering_test.sh"
done

# A .cc whose first include is a public header implements it: it must sit in the table's folder.
while IFS= read -r file; do
  first=$(grep -m1 -o '^#include "[^"]*"' "$file" || true)
  [[ "$first" == '#include "gpipe/'* ]] || continue
  name=${first#\#include \"gpipe/}
  name=${name%.h\"}
  folder=$(cut -d/ -f2 <<<"$file")
  [[ -z "${home[$name]:-}" || "${home[$name]}" == "$folder" ]] ||
    fail "$file implements gpipe/$name.h, which the table places in ${home[$name]}/; move one of them"
done < <(find src -name '*.cc' | sort)

# The folder of an included path, or nothing for one outside gpipe.
folder_of_include() {
  case "$1" in
    gpipe/*.h) local name=${1#gpipe/}; echo "${home[${name%.h}]:-unknown}" ;;
    */*) echo "${1%%/*}" ;;
    *) echo "" ;;
  esac
}

while IFS= read -r file; do
  case "$file" in
    include/gpipe/*) name=$(basename "$file" .h); folder=${home[$name]:-unknown} ;;
    src/*) folder=$(cut -d/ -f2 <<<"$file") ;;
  esac
  if [[ -z "${rung[$folder]:-}" ]]; then
    fail "$file is in folder $folder, which is not on the ladder (${ladder[*]})"
    continue
  fi
  while IFS= read -r line; do
    included=$(sed -E 's/^#include "([^"]*)".*/\1/' <<<"$line")
    target=$(folder_of_include "$included")
    [[ -n "$target" ]] || continue
    if [[ -z "${rung[$target]:-}" ]]; then
      fail "$file includes \"$included\", which is in no folder of the ladder"
    elif ((${rung[$target]} > ${rung[$folder]})); then
      fail "$file ($folder/) includes \"$included\" ($target/), above it in the ladder ${ladder[*]}"
    fi
  done < <(grep -E '^\s*#\s*include "' "$file" | sed -E 's/^\s*#\s*include/#include/')
done < <({ find src -name '*.cc' -o -name '*.h'; ls include/gpipe/*.h; } | sort)

# The library speaks its own words: its messages name options as `micro_batches` (the command line
# shows them as its flags, apps/common.cc in_flags; Python as its arguments), never as a --flag
# (a launcher's flags aside: torchrun's, in the command that resumes a run). The settings' tables
# (src/tasks/settings.cc, bench_fields.cc) are where each flag is written, once: their flag column.
while IFS= read -r hit; do
  rest=${hit#*:}
  fail "${hit%%:*} line ${rest%%:*}: a message names the command-line flag ${rest#*:}; name the library's option in backquotes"
done < <(grep -rnoE '"[^"]*--[a-z][a-z_-]+' src --include='*.cc' --include='*.h' | grep -vE '^src/tasks/(settings|bench_fields).cc:' | sed -E 's/^([^:]*:[0-9]+):.*(--[a-z_-]+)$/\1:\2/' |
         grep -vE ':--(nproc_per_node|no_python)$')  # torchrun's own flags, in a command to run again

# MPI stays behind the backend boundary (include/gpipe/backend.h): no MPI call or type outside the
# MPI backend (src/transport/mpi/, its public headers mpi_backend.h and mpi.h) and its own tests;
# the runtime, the front ends and the Python package reach it through backend.h and job.h. Nor
# does any file outside src/transport/ include the MPI backend's headers (gpipe.h, the umbrella,
# aside): a second backend then needs no change there.
mpi_own='^(src/transport/mpi/|include/gpipe/mpi_backend\.h:|include/gpipe/mpi\.h:|tests/mpi_[a-z_]*\.(cc|h):)'
while IFS= read -r hit; do
  rest=${hit#*:}
  fail "${hit%%:*} line ${rest%%:*} calls MPI (${rest#*:}); only the MPI backend (src/transport/mpi/) may: go through gpipe/backend.h (running_backend, all_gather_processes, BackendEntry) or gpipe/job.h"
done < <(for dir in src include apps python/src examples bench tests; do
           [[ -d "$dir" ]] && grep -rnoE '\bMPI_[A-Za-z_]+|#\s*include\s*<mpi\.h>' "$dir" \
             --include='*.cc' --include='*.h' --include='*.cpp' --include='*.c'
         done | grep -vE "$mpi_own" || true)
while IFS= read -r hit; do
  rest=${hit#*:}
  fail "${hit%%:*} line ${rest%%:*} includes the MPI backend's header (${rest#*:}); outside src/transport/ go through gpipe/backend.h or gpipe/job.h"
done < <(for dir in src include apps python/src examples; do
           [[ -d "$dir" ]] && grep -rnoE '#\s*include\s*[<"]gpipe/mpi(_backend)?\.h[>"]' "$dir" --include='*.cc' --include='*.h'
         done | grep -vE '^(src/transport/|include/gpipe/(gpipe|mpi|mpi_backend)\.h:)' || true)

if ((failures > 0)); then
  echo "layering: $failures problem(s): the ladder is ${ladder[*]} (lowest first; docs/architecture.md)" >&2
  exit 1
fi
echo "layering: every include of src/ and include/gpipe/ keeps to the ladder ${ladder[*]}"
