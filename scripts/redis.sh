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

# Valkey (issue 26: the remote tier speaks to Redis ≥ 7 and Valkey): Debian's valkey-tools and
# valkey-server packages, fetched with apt-get from the release's own suite where it has them
# (trixie on) or bookworm-backports (signatures checked against Debian's archive keyring), unpacked
# under the environment cache — not installed, nothing outside the cache changes — and reused by
# later runs without the network. Sets VALKEY_BIN to the folder with valkey-server, valkey-cli and
# valkey-benchmark, or leaves it empty, saying why, where that cannot be done here.
ensure_valkey() {
  VALKEY_BIN=""
  local root="$KVOFF_ENV_CACHE/valkey"
  if [ -x "$root/usr/bin/valkey-server" ] && "$root/usr/bin/valkey-server" --version >/dev/null 2>&1; then
    VALKEY_BIN="$root/usr/bin"
    return 0
  fi
  local keyring=/usr/share/keyrings/debian-archive-keyring.gpg codename suite
  codename=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
  if ! command -v apt-get >/dev/null || [ ! -r "$keyring" ] || [ -z "$codename" ]; then
    echo "Valkey: not a Debian system with apt-get and Debian's keyring: the Valkey pass is skipped" >&2
    return 0
  fi
  case "$codename" in
    bookworm) suite=bookworm-backports ;;
    *) suite="$codename" ;;
  esac
  local tmp
  tmp=$(mktemp -d)
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/debs"
  echo "deb [signed-by=$keyring] http://deb.debian.org/debian $suite main" >"$tmp/sources.list"
  local apt=(apt-get -q -o "Dir::Etc::SourceList=$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o Debug::NoLocking=1
    -o APT::Sandbox::User=root)
  if "${apt[@]}" update >/dev/null 2>&1 \
    && (cd "$tmp/debs" && "${apt[@]}" download valkey-tools valkey-server >/dev/null 2>&1); then
    rm -rf "$root.new" && mkdir -p "$root.new"
    local d
    for d in "$tmp"/debs/*.deb; do dpkg-deb -x "$d" "$root.new"; done
    if "$root.new/usr/bin/valkey-server" --version; then
      rm -rf "$root" && mv "$root.new" "$root"
      VALKEY_BIN="$root/usr/bin"
    else
      echo "Valkey: the unpacked valkey-server does not run here: the Valkey pass is skipped" >&2
    fi
  else
    echo "Valkey: apt-get could not fetch valkey-tools from $suite: the Valkey pass is skipped" >&2
  fi
  rm -rf "$tmp"
}
