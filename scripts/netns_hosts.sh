#!/usr/bin/env bash
# Hosts by hand for trying meshyard on several nodes on one machine: each host is a Linux
# network namespace (its own interfaces, addresses and routes, the machine's hostname and
# filesystem), joined to the others by a bridge in a namespace of its own, so no traffic
# leaves the namespaces. Needs root and iproute2. A thin wrapper of `python -m tests.netns`.
#
#   scripts/netns_hosts.sh up 2 [--networks 2]   # hosts myhand-h0, myhand-h1; prints addresses
#   scripts/netns_hosts.sh exec 0 CMD...         # run CMD on host 0 (no CMD: a shell there)
#   scripts/netns_hosts.sh up 3 --prefix mine    # another set; then `exec --prefix mine 2 CMD`
#   scripts/netns_hosts.sh list                  # the harness's namespaces and addresses
#   scripts/netns_hosts.sh down [--prefix mine]  # remove the hosts (and sets left by killed tests)
#
# For example, two nodes of one job, each in its own terminal:
#   scripts/netns_hosts.sh exec 0 .venv/bin/meshyard run CONFIG --nnodes 2 --nproc-per-node 2 \
#       --rdzv-endpoint 10.K.0.1:29400 --rdzv-id demo
#   scripts/netns_hosts.sh exec 1 .venv/bin/meshyard run CONFIG ...same arguments...
# with 10.K.0.1 the address `up` printed for host 0.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
python=$here/.venv/bin/python
[ -x "$python" ] || python=python3
command=${1:-}
case "$command" in
  # Run as a file, not `-m tests.netns`: commands then run in the caller's directory with
  # the caller's environment, so relative paths in them mean what they say.
  up|down|list) shift; exec "$python" "$here/tests/netns.py" "$command" "$@" ;;
  exec) shift; exec "$python" "$here/tests/netns.py" exec "$@" ;;
  *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2 ;;
esac
