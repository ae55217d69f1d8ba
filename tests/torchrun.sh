#!/usr/bin/env bash
# tests/torchrun.sh NP PROGRAM [ARGS...]: PROGRAM under torchrun, NP processes on this machine, on a
# free port of its own (CTest runs several jobs at once). Debian's torchrun (torch 1.13 on Python
# 3.11) starts only with --redirects, --tee and --log_dir given (docs/distributed.md).
set -euo pipefail
np=$1
shift
python=/usr/bin/python3
[ -x "$python" ] || python=python3
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
"$python" -m torch.distributed.run --redirects 2 --tee 2 --log_dir "$logs" --nproc_per_node "$np" \
  --master_addr 127.0.0.1 --master_port "$port" --no_python "$@"
