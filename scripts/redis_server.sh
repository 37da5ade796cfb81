#!/usr/bin/env bash
# A Redis on loopback for a shared prediction cache (`meshyard serve --cache redis://...`) and
# for the tests: installs Debian's redis-server when missing, starts one server on PORT bound
# to 127.0.0.1 without persistence, and waits until it answers PING.
# Idempotent: when the server of PIDFILE already runs and answers, it changes nothing.
# Installing needs root and apt-get; starting does not.
#
#   scripts/redis_server.sh 6379 /tmp/redis-6379/redis.pid   # then: redis-cli -p 6379 ping
#   kill "$(cat /tmp/redis-6379/redis.pid)"                    # stops it
#
# PIDFILE defaults to /tmp/meshyard-redis-PORT/redis.pid; its folder is also Redis's working
# directory. Exits non-zero with one line saying what failed when it cannot.
set -uo pipefail

fail() { echo "redis_server: $*" >&2; exit 1; }

port=${1:-}
[[ "$port" =~ ^[0-9]+$ ]] && ((port > 0 && port < 65536)) \
  || fail "usage: scripts/redis_server.sh PORT [PIDFILE] (PORT a number 1-65535, got '${port}')"
pidfile=${2:-/tmp/meshyard-redis-$port/redis.pid}
dir=$(dirname "$pidfile")

install_packages() {
  command -v redis-server >/dev/null && command -v redis-cli >/dev/null && return 0
  [ "$(id -u)" = 0 ] || fail "redis-server is not installed and installing it needs root; run: sudo apt-get install redis-server"
  command -v apt-get >/dev/null || fail "redis-server is not installed and there is no apt-get to install it"
  export DEBIAN_FRONTEND=noninteractive
  # Several test sessions may ask at once: wait for dpkg's lock rather than failing on it.
  local wait=(-o DPkg::Lock::Timeout=300)
  apt-get "${wait[@]}" update -qq >/dev/null 2>&1 || fail "apt-get update failed (no network or no package sources?)"
  apt-get "${wait[@]}" install -y -qq --no-install-recommends redis-server redis-tools >/dev/null 2>&1 \
    || fail "apt-get install redis-server redis-tools failed"
  command -v redis-server >/dev/null || fail "apt-get installed redis-server but it is not on PATH"
}

# Bounded: something else listening on the port may never answer redis-cli.
answers() { [ "$(timeout 2 redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null)" = PONG ]; }

running() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile" 2>/dev/null)" 2>/dev/null; }

start_server() {
  if running && answers; then return 0; fi
  # A server answering on the port that is not ours would be taken for ours: refuse it.
  answers && fail "port $port already has a Redis that $pidfile does not name; choose another port"
  mkdir -p "$dir" || fail "cannot create $dir"
  rm -f "$pidfile"
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
    --pidfile "$pidfile" --dir "$dir" --logfile "$dir/redis.log" >/dev/null 2>&1 \
    || fail "redis-server did not start on port $port (see $dir/redis.log)"
  local i
  for ((i = 0; i < 100; i++)); do
    answers && return 0
    # It daemonizes before binding: a port taken by another program shows only in its log.
    if ((i >= 10)) && ! running; then
      fail "redis-server on port $port exited: $(tail -n1 "$dir/redis.log" 2>/dev/null | sed 's/^[^#*]*[#*] //')"
    fi
    sleep 0.1
  done
  fail "redis-server on port $port did not answer PING within 10s (see $dir/redis.log)"
}

install_packages
start_server
echo "redis_server: up: redis://127.0.0.1:$port/0 (pid $(cat "$pidfile" 2>/dev/null), pidfile $pidfile)"
