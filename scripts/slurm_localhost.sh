#!/usr/bin/env bash
# A one-node Slurm on this machine, for trying `meshyard slurm submit` and for the tests:
# installs Debian's slurm-wlm, slurm-client and munge when missing, writes slurm.conf for
# this host (node name `hostname -s`, CPUs and memory from `slurmd -C`), starts munged,
# slurmctld and slurmd unless already running, and waits until the node is idle.
# Idempotent: running it again with everything up changes nothing. Needs root and apt-get.
#
#   sudo scripts/slurm_localhost.sh        # then: sinfo; sbatch ...
#
# Exits non-zero with one line saying what failed when it cannot.
set -uo pipefail

fail() { echo "slurm_localhost: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (it installs packages and starts daemons); run it with sudo"

install_packages() {
  command -v slurmctld >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null && return 0
  command -v apt-get >/dev/null || fail "slurm-wlm/munge are not installed and there is no apt-get to install them"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null 2>&1 || fail "apt-get update failed (no network or no package sources?)"
  apt-get install -y -qq slurm-wlm slurm-client munge >/dev/null 2>&1 \
    || fail "apt-get install slurm-wlm slurm-client munge failed"
}

write_config() {
  local host hw conf=/etc/slurm/slurm.conf tmp
  host=$(hostname -s)
  # slurmd -C prints "NodeName=<host> CPUs=... RealMemory=..." and an UpTime line.
  hw=$(slurmd -C 2>/dev/null | head -n1 | sed -e 's/^NodeName=[^ ]* //') || true
  [ -n "$hw" ] || fail "slurmd -C printed no hardware description"
  mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm
  tmp=$(mktemp)
  cat >"$tmp" <<EOF
ClusterName=localcluster
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
MailProg=/bin/true
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again after ~11 s instead of ~121 s.
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
ReturnToService=2
JobRequeue=1
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SchedulerType=sched/backfill
# The main scheduler runs every 60 s by default: a requeued job would wait that long.
SchedulerParameters=bf_interval=5,sched_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$host $hw State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  # Rewrite only when it changed, so running daemons never see a config they did not read.
  if cmp -s "$tmp" "$conf"; then rm -f "$tmp"; return 0; fi
  mv "$tmp" "$conf"; chmod 644 "$conf"
  config_changed=1
}

config_changed=0

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local limit=$1 what=$2 i; shift 2
  for ((i = 0; i < limit * 10; i++)); do "$@" && return 0; sleep 0.1; done
  fail "$what did not happen within ${limit}s (see /var/log/slurm/)"
}

start_daemons() {
  mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null
  if ! running /run/munge/munged.pid; then
    su -s /bin/sh munge -c munged 2>/dev/null || runuser -u munge -- munged || fail "munged did not start"
  fi
  wait_for 10 "munge -n | unmunge" sh -c 'munge -n | unmunge >/dev/null 2>&1'
  # A second slurmctld would replace the first: start only when none runs.
  running /run/slurmctld.pid || slurmctld || fail "slurmctld did not start (see /var/log/slurm/slurmctld.log)"
  wait_for 20 "slurmctld answering ping" sh -c 'scontrol ping 2>/dev/null | grep -q UP'
  # Daemons started before the config changed read it again.
  [ "$config_changed" = 0 ] || scontrol reconfigure || fail "scontrol reconfigure failed after slurm.conf changed"
  running /run/slurmd.pid || slurmd || fail "slurmd did not start (see /var/log/slurm/slurmd.log)"
  wait_for 30 "node idle in sinfo" sh -c 'sinfo -h -o %t 2>/dev/null | grep -qE "^(idle|mix|alloc)"'
}

install_packages
write_config
start_daemons
echo "slurm_localhost: up: $(sinfo -h -o '%P %D %t %N' | head -n1)"
