#!/usr/bin/env bash
# Installs the Debian packages the build and tests need (idempotent; skips what is present).
set -euo pipefail
packages=(cmake ninja-build g++ pkg-config nlohmann-json3-dev libyaml-cpp-dev libgtest-dev
          libgmock-dev libbenchmark-dev libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev
          protobuf-compiler libsystemd-dev prometheus-cpp-dev libncurses-dev python3 python3-yaml
          systemd passwd procps clang-16 libclang-rt-16-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
