#!/usr/bin/env bash
# Installs the Debian packages gpipe needs, only those that are missing.
#   scripts/install-deps.sh [PACKAGE...]   also these (scripts/sanitize.sh adds libFuzzer's runtime)
set -euo pipefail

packages=(
  build-essential cmake git
  clang                   # the compiler scripts/build.sh prefers: a fresh build in less than half of g++'s time
  ccache                  # a rebuild (a clean build, another branch) reuses what an earlier build compiled
  libtorch-dev            # PyTorch's C++ API (libtorch)
  libopenblas0-pthread    # fast system BLAS: without it libtorch's matmuls are ~35x slower
  libgtest-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev zlib1g-dev
  libopenmpi-dev openmpi-bin  # MPI: one device (its stages) per process, on one machine or many
  libgloo-dev             # Gloo's headers: the c10d backend (torchrun, torch.distributed)
  dataset-fashion-mnist   # the default training data, under /usr/share/datasets/fashion-mnist
  fortunes                # gpipe train --model gpt's text, under /usr/share/games/fortunes
  python3-torch           # Python PyTorch: the gpipe Python package, interop and comparison tests
  python3-torchvision     # models nobody here wrote (torchvision's, as shipped), in the Python tests
  python3-dev pybind11-dev  # the gpipe Python package (a pybind11 extension)
  python3-pytest          # the Python package's tests
  librsvg2-bin            # rsvg-convert, to look at timeline charts
  "$@"
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
