#!/usr/bin/env bash
# Debian's redis-server and redis-tools (redis-cli, redis-benchmark) for the remote tier's tests, and
# openssl (the TLS tests make a throwaway CA with it)
# (tests/python/redis_servers.py starts its own servers on loopback; the package's system service
# is not used). Sourced by scripts/test.sh; installs only what is missing, quietly. Where apt-get
# cannot run (not root, no network), it says so and the real-server tests skip, saying why.

ensure_redis() {
  if command -v redis-server >/dev/null && command -v redis-cli >/dev/null \
    && command -v redis-benchmark >/dev/null && command -v openssl >/dev/null; then
    return 0
  fi
  local sudo=()
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo=(sudo -n); else
      echo "redis-server is missing and apt-get needs root: the remote-tier tests will skip" >&2
      return 0
    fi
  fi
  echo "installing Debian's redis-server and redis-tools (apt-get)"
  # policy-rc.d or not, the package's own service is not needed: stop it if it started.
  if { "${sudo[@]}" apt-get -q update -o DPkg::Lock::Timeout=300 >/dev/null \
       && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get -q install -y --no-install-recommends \
          -o DPkg::Lock::Timeout=300 redis-server redis-tools openssl >/dev/null; }; then
    "${sudo[@]}" systemctl disable --now redis-server >/dev/null 2>&1 || true
    redis-server --version
  else
    echo "apt-get could not install redis-server: the remote-tier tests will skip" >&2
  fi
}
