#!/usr/bin/env bash
# multihost_test.sh: gpipe across two hosts, simulated on this machine by two network namespaces
# joined by a veth pair. mpirun starts in the first namespace; Open MPI's rsh launcher reaches the
# second through a plm_rsh_agent script that runs the daemon inside the namespace its host argument
# names; TCP only (no shared memory), over the veth subnet. Checks that np=2 (one rank per host)
# trains to the parameters of one process, bit for bit, and that `gpipe bench --transport` runs
# across the hosts. Exits 77 (skipped) where namespaces cannot be made; removes them on every exit.
# Usage: multihost_test.sh PATH/TO/gpipe
set -u
gpipe="$1"
failures=0
pass() { echo "ok: $1"; }
fail() { echo "FAILED: $1"; failures=$((failures + 1)); }
skip() { echo "skipped: $1"; exit 77; }

# Unique per run, so parallel runs never meet; interface names stay within 15 characters.
host_a=gpipe-a-$$ host_b=gpipe-b-$$ veth_a=gpva$$ veth_b=gpvb$$
subnet=10.77.0.0/24 addr_a=10.77.0.1 addr_b=10.77.0.2
work=$(mktemp -d)
made=()  # the namespaces this run created
child=   # the command running now, in the background so that a signal acts at once

cleanup() {
  local ns pid
  [ -z "$child" ] || kill "$child" 2>/dev/null
  for ns in "${made[@]}"; do
    # Whatever this run left inside (a daemon of a killed mpirun), then the namespace with its veth end.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
  ip link del "$veth_a" 2>/dev/null  # only if it never reached its namespace
  [ -z "$child" ] || wait "$child" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

[ "$(id -u)" -eq 0 ] || skip "network namespaces need root (this is uid $(id -u))"
command -v ip >/dev/null || skip "no \`ip\` (iproute2) on PATH"
command -v mpirun >/dev/null || skip "no mpirun on PATH"
mpirun --version 2>/dev/null | grep -q "Open MPI" || skip "the launch recipe is Open MPI's (plm_rsh_agent); mpirun here is not"
for ns in "$host_a" "$host_b"; do
  ip netns add "$ns" 2>"$work/ip.err" || skip "cannot create a network namespace: $(head -1 "$work/ip.err")"
  made+=("$ns")
  ip netns exec "$ns" true 2>"$work/ip.err" || skip "cannot enter a network namespace: $(head -1 "$work/ip.err")"
done
ip link add "$veth_a" type veth peer name "$veth_b" 2>"$work/ip.err" ||
  skip "cannot create a veth pair: $(head -1 "$work/ip.err")"
if ! { ip link set "$veth_a" netns "$host_a" && ip link set "$veth_b" netns "$host_b" &&
       ip -n "$host_a" addr add "$addr_a/24" dev "$veth_a" && ip -n "$host_b" addr add "$addr_b/24" dev "$veth_b" &&
       ip -n "$host_a" link set lo up && ip -n "$host_b" link set lo up &&
       ip -n "$host_a" link set "$veth_a" up && ip -n "$host_b" link set "$veth_b" up; } 2>"$work/ip.err"; then
  skip "cannot set up the veth pair: $(head -1 "$work/ip.err")"
fi

# The rsh agent: AGENT [OPTIONS] HOST COMMAND... runs COMMAND in HOST's namespace, as ssh would on HOST.
cat >"$work/agent.sh" <<EOF
#!/bin/sh
while [ "\${1#-}" != "\$1" ]; do shift; done
host="\$1"
shift
case "\$host" in
  $addr_a) ns=$host_a ;;
  $addr_b) ns=$host_b ;;
  *) echo "agent.sh: no namespace for host \$host" >&2; exit 255 ;;
esac
exec ip netns exec "\$ns" /bin/sh -c "\$*"
EOF
chmod +x "$work/agent.sh"
printf '%s slots=1\n%s slots=1\n' "$addr_a" "$addr_b" >"$work/hosts"

# One rank per host; TCP over the veth subnet only (btl tcp,self: no shared memory between the
# "hosts"). --bind-to none: each namespace sees all of this machine's cores, so Open MPI's default
# binding would put both ranks on core 0, where their busy polling costs a scheduler tick (4 ms)
# per message. The eager limit of 4 MiB sends each boundary tensor whole, so it travels while its
# stage computes (docs/mpi.md, "Two hosts on one machine").
# Each command's limit only tells a hang (they take seconds to tens of seconds on a quiet machine); all
# of them fit in CTest's TIMEOUT of 900 s, so that the namespaces are removed on every exit.
bounded() {  # bounded SECONDS COMMAND...: COMMAND under timeout
  local seconds="$1" status
  shift
  timeout -k 10 "$seconds" "$@" &
  child=$!
  wait "$child"
  status=$?
  child=
  return "$status"
}
across() {  # across SECONDS COMMAND...: mpirun -np 2 from inside host A
  local seconds="$1"
  shift
  bounded "$seconds" ip netns exec "$host_a" \
    mpirun --allow-run-as-root -np 2 --hostfile "$work/hosts" --map-by node --bind-to none \
      --mca plm rsh --mca plm_rsh_agent "$work/agent.sh" \
      --mca oob_tcp_if_include "$subnet" --mca btl_tcp_if_include "$subnet" --mca btl tcp,self \
      --mca btl_tcp_eager_limit 4194304 --mca btl_tcp_rndv_eager_limit 4194304 --mca btl_tcp_max_send_size 4194304 "$@"
}
veth_bytes() { ip netns exec "$host_a" cat "/sys/class/net/$veth_a/statistics/tx_bytes" 2>/dev/null || echo 0; }
checksum() { /usr/bin/python3 -c 'import json,sys; print(repr(json.load(open(sys.argv[1]))["parameter_checksum"]))' "$1"; }

# Each rank runs in its own host's namespace (the rank's shell expands the variables, not this one),
# and on every core this test may use (--bind-to none: not both on core 0, see above).
# shellcheck disable=SC2016
if across 60 sh -c 'echo "$OMPI_COMM_WORLD_RANK $(ip -o -4 addr show scope global | awk "{print \$4}")"' \
     >"$work/where.txt" 2>"$work/where.err" &&
   [ "$(sort "$work/where.txt" | tr '\n' ' ')" = "0 $addr_a/24 1 $addr_b/24 " ]; then
  pass "rank 0 runs on host $addr_a, rank 1 on host $addr_b"
else fail "placement across the namespaces"; cat "$work/where.txt"; tail -20 "$work/where.err"; fi
cores=$(sed -n 's/^Cpus_allowed_list:\s*//p' /proc/self/status)
# shellcheck disable=SC2016
if across 60 sh -c 'echo "$OMPI_COMM_WORLD_RANK $(sed -n "s/^Cpus_allowed_list:\s*//p" /proc/self/status)"' \
     >"$work/cores.txt" 2>"$work/where.err" &&
   [ "$(sort "$work/cores.txt" | tr '\n' ' ')" = "0 $cores 1 $cores " ]; then
  pass "each rank may run on cores $cores, as this test"
else fail "the ranks' cores: $(cat "$work/cores.txt"), not $cores each"; tail -20 "$work/where.err"; fi

# (a) Two hosts train to the parameters of one process, bit for bit.
small=(train --schedule task --train-samples 1024 --test-samples 200 --steps 10 --json)
sent_before=$(veth_bytes)
if bounded 120 "$gpipe" "${small[@]}" >"$work/one.json" 2>"$work/one.err" &&
   across 120 "$gpipe" "${small[@]}" >"$work/two.json" 2>"$work/two.err"; then
  sent=$(( $(veth_bytes) - sent_before ))
  a=$(checksum "$work/one.json"); b=$(checksum "$work/two.json")
  if [ "$a" = "$b" ]; then pass "np=2 across two hosts: parameters equal one process ($a)"
  else fail "np=2 across two hosts: checksum $b, one process $a"; fi
  # 10 steps send about 110 MiB of boundary tensors out of host A; all of it must cross the veth.
  if [ "$sent" -gt $((60 << 20)) ]; then pass "the ranks' messages crossed the veth ($((sent >> 20)) MiB out of host A)"
  else fail "only $sent bytes left host A through the veth"; fi
else fail "train across two hosts exited non-zero"; tail -5 "$work/one.err" "$work/two.err"; fi

# (b) The transport's latency and bandwidth across the hosts (figures for the reader: tens of
# microseconds one way for 8 bytes here; about 4000 would mean both ranks polling on one core, which
# the check of the ranks' cores above rules out without a clock).
if across 300 "$gpipe" bench --transport --results "" >"$work/bench.txt" 2>"$work/bench.err" &&
   grep -q "one-way us" "$work/bench.txt" && grep -Eq '^ +16777216 ' "$work/bench.txt"; then
  pass "gpipe bench --transport across two hosts:"
  cat "$work/bench.txt"
else fail "bench --transport across two hosts"; cat "$work/bench.txt"; tail -20 "$work/bench.err"; fi

echo "$failures failure(s)"
[ "$failures" -eq 0 ]
