#!/usr/bin/env bash
# Copies the dependencies a machine without a package registry may lack (the lent GPU machine)
# from this machine's Debian packages into third_party/ (ignored by git), which CMake finds by
# itself (GPIPE_THIRD_PARTY) wherever the system has none:
#   third_party/usr/include/{CLI,nlohmann}, zlib.h, zconf.h   header-only CLI11, nlohmann-json; zlib's headers
#   third_party/usr/share/cmake/{CLI11,nlohmann_json}         their CMake packages (relocatable)
#   third_party/googletest                                    GoogleTest's sources, built with the tests
# Usage: bash scripts/vendor-deps.sh [DEST]   (needs libcli11-dev, nlohmann-json3-dev, zlib1g-dev,
# googletest: bash scripts/install-deps.sh installs them). Copy DEST along with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-third_party}"

need() {  # need PATH PACKAGE
  if [ ! -e "$1" ]; then
    echo "vendor-deps: $1 is missing: install the Debian package $2 (apt-get install $2)" >&2
    exit 1
  fi
}
need /usr/include/CLI/CLI.hpp libcli11-dev
need /usr/share/cmake/CLI11/CLI11Config.cmake libcli11-dev
need /usr/include/nlohmann/json.hpp nlohmann-json3-dev
need /usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake nlohmann-json3-dev
need /usr/include/zlib.h zlib1g-dev
need /usr/include/zconf.h zlib1g-dev
need /usr/src/googletest/CMakeLists.txt googletest

rm -rf "$dest.tmp"
mkdir -p "$dest.tmp/usr/include" "$dest.tmp/usr/share/cmake"
cp -r /usr/include/CLI /usr/include/nlohmann /usr/include/zlib.h /usr/include/zconf.h "$dest.tmp/usr/include/"
cp -r /usr/share/cmake/CLI11 /usr/share/cmake/nlohmann_json "$dest.tmp/usr/share/cmake/"
cp -r /usr/src/googletest "$dest.tmp/googletest"
cat >"$dest.tmp/README" <<EOF
Copied by scripts/vendor-deps.sh from Debian packages on $(date -u +%Y-%m-%d):
$(dpkg-query -W -f '${Package} ${Version}\n' libcli11-dev nlohmann-json3-dev zlib1g-dev googletest 2>/dev/null || true)
Licences: CLI11 BSD-3-Clause, nlohmann-json MIT, zlib Zlib, GoogleTest BSD-3-Clause
(/usr/share/doc/<package>/copyright).
EOF
rm -rf "$dest"
mv "$dest.tmp" "$dest"
echo "vendor-deps: $(du -sh "$dest" | cut -f1) in $dest"
