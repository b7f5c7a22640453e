#!/usr/bin/env bash
# ci-cluster-up.sh - bring up a single-node Slurm cluster (munged + slurmctld + slurmd) on
# localhost, for CI and for trying the sbatch scripts in slurm/ on one machine. Debian 12
# (or Ubuntu), run as root, no systemd needed. Idempotent: re-running it with everything up
# is a no-op; a changed config restarts only the daemons this script started. Daemons this
# script starts are recorded in $SLURM_CI_BASE/run/*.pid; ci-cluster-down.sh stops exactly
# those PIDs (never by name).
#
#   sudo slurm/ci-cluster-up.sh                 # install packages if missing, start, smoke test
#   sudo slurm/ci-cluster-up.sh --install-only  # only install the Debian packages (.ci/setup)
#   sbatch -n 2 slurm/train.sbatch --epochs 1   # ... use it ...
#   sudo slurm/ci-cluster-down.sh               # stop what this script started
#
# Knobs (env):
#   SLURM_CI_BASE=/tmp/slurm-ci   state, spool, logs, pid files
#   SLURM_CI_CPUS=8               CPUs advertised to Slurm (more than the real cores, so
#                                 `-n 4` fits on a 2-core box; slurmd accepts it because of
#                                 SlurmdParameters=config_overrides)
#   SLURM_CI_PMIX=0               1: also install libpmix-dev so `srun --mpi=pmix` works
#                                 (Open MPI); mpidl's default pip MPICH needs only pmi2
#   SLURM_CI_SMOKE=1              finish with `srun -n 4 true`
#
# Pitfalls this script handles (see the comments where each is handled): packages' init
# scripts must not start daemons (policy-rc.d); the host name must resolve; job start is
# batched every 3 s by default (batch_sched_delay=0); a job killed without MPI_Finalize
# leaves MPICH /dev/shm segments that a later job with the same id attaches to
# (clean_stale_mpi_shm); a rank that dies must kill its step (KillOnBadExit=1).
set -euo pipefail

BASE=${SLURM_CI_BASE:-/tmp/slurm-ci}
CPUS=${SLURM_CI_CPUS:-8}
WITH_PMIX=${SLURM_CI_PMIX:-0}
SMOKE=${SLURM_CI_SMOKE:-1}
RUN=$BASE/run LOG=$BASE/log STATE=$BASE/state
CONF_DIR=/etc/slurm
HOST=$(hostname -s)
T_START=$EPOCHREALTIME

log()  { printf '[ci-cluster-up %6.2fs] %s\n' "$(awk "BEGIN{print $EPOCHREALTIME - $T_START}")" "$*"; }
die()  { log "ERROR: $*"; for f in "$LOG"/slurmctld.log "$LOG"/slurmd.log; do [ -f "$f" ] && { echo "== tail $f"; tail -n 30 "$f"; }; done; exit 1; }
# alive PIDFILE COMM: the pid in PIDFILE exists, is not a zombie, and runs COMM
alive() {
  local pid st
  [ -s "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$2" ] || return 1
  st=$(awk '{print $3}' /proc/"$pid"/stat 2>/dev/null) || return 1
  [ "$st" != Z ]
}
wait_for() { # TIMEOUT_S CMD... : poll CMD every 0.2s
  local t=$1; shift
  local n=$(( t * 5 ))
  for ((i = 0; i < n; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  return 1
}

# MPICH names its /dev/shm segment after the PMI job/step id (mpich_shm_<hash>_0) and only
# unlinks it at MPI_Finalize, so killed jobs leave segments behind. When slurmctld restarts
# with clean state, job ids start again at 1 and a new job attaches to the stale segment and
# hangs or dies ("Message truncated", "Out of memory"). Remove MPI segments no process uses.
clean_stale_mpi_shm() {
  local f in_use n=0
  in_use=$( { cat /proc/[0-9]*/maps 2>/dev/null | awk '$6 ~ /^\/dev\/shm\//{print $6}'
              find /proc/[0-9]*/fd -maxdepth 1 -lname '/dev/shm/*' -printf '%l\n' 2>/dev/null; } | sort -u)
  for f in /dev/shm/mpich_shm_* /dev/shm/sm_segment.* /dev/shm/vader_segment.*; do
    [ -f "$f" ] || continue
    grep -qxF "$f" <<<"$in_use" && continue
    rm -f "$f" && n=$((n + 1))
  done
  [ "$n" = 0 ] || echo "removed $n stale MPI shared-memory segment(s) from /dev/shm"
}

INSTALL_ONLY=0
case ${1:-} in
  --install-only) INSTALL_ONLY=1 ;;
  "") ;;
  *) echo "usage: $0 [--install-only]" >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || { echo "ci-cluster-up.sh must run as root (it installs packages and starts munged, slurmctld, slurmd)" >&2; exit 1; }

# ---------------------------------------------------------------- 1. packages
PKGS="munge slurmctld slurmd slurm-client"
[ "$WITH_PMIX" = 1 ] && PKGS="$PKGS libpmix-dev"   # slurm's mpi_pmix_v4.so dlopen()s the unversioned libpmix.so
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"
done
if [ -n "$missing" ]; then
  log "installing:$missing"
  # keep package maintainer scripts from starting munge/slurm via init scripts or systemd
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  export DEBIAN_FRONTEND=noninteractive
  # try without 'apt-get update' first: .ci/setup may have just updated the lists
  apt-get install -y -qq --no-install-recommends $missing >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing >/dev/null; } \
    || die "apt-get install$missing failed"
  log "packages installed"
else
  log "packages already installed"
fi
[ "$INSTALL_ONLY" = 1 ] && exit 0

# ---------------------------------------------------------------- 2. dirs, host name, munge key
mkdir -p "$RUN" "$LOG" "$STATE/ctld" "$STATE/d" "$CONF_DIR"
if ! getent hosts "$HOST" >/dev/null; then
  echo "127.0.0.1 $HOST" >> /etc/hosts; log "added $HOST to /etc/hosts"
fi
install -d -o munge -g munge -m 0700 /etc/munge
if [ ! -s /etc/munge/munge.key ]; then
  head -c 1024 /dev/urandom > /etc/munge/munge.key; log "created /etc/munge/munge.key"
fi
chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key

# ---------------------------------------------------------------- 3. config
cat > "$BASE/slurm.conf.new" <<EOF
# single-node CI cluster, generated by mpidl slurm/ci-cluster-up.sh
ClusterName=ci
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups anywhere
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# start batch jobs within ~1 s of submission (default batch_sched_delay=3 batches them every 3 s)
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# plain 'srun' = PMI-2 (MPICH); use 'srun --mpi=pmix' for Open MPI
MpiDefault=pmi2
# exports OMPI_MCA_mpi_yield_when_idle=1 etc. into every task and batch script
TaskProlog=$BASE/task_prolog.sh
# accept CPUs=$CPUS although the box has fewer cores
SlurmdParameters=config_overrides
ReturnToService=2
# a rank that dies kills the whole step (srun default would leave the others blocked in MPI)
KillOnBadExit=1
# reject impossible requests at submit time instead of pending forever
EnforcePartLimits=ALL
MailProg=/bin/true
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${CPUS} Sockets=1 CoresPerSocket=${CPUS} ThreadsPerCore=1 RealMemory=$(awk '/MemTotal/{print int($2/1024)}' /proc/meminfo) State=UNKNOWN
PartitionName=debug Nodes=${HOST} Default=YES MaxTime=INFINITE State=UP
EOF
cat > "$BASE/mpi.conf.new" <<'EOF'
# pip/bundled PMIx clients lack the munge psec plugin; this silences "find-available:not-valid"
PMIxEnv=PMIX_MCA_psec=native
EOF
cat > "$BASE/task_prolog.sh.new" <<'EOF'
#!/bin/sh
# slurmstepd adds every "export NAME=VALUE" line printed here to the task environment.
# Open MPI busy-polls without yielding when it does not know it is oversubscribed
# (10-40 ms per Allreduce with 4 ranks on 2 cores); yield_when_idle fixes that.
[ -n "${OMPI_MCA_mpi_yield_when_idle:-}" ] || echo "export OMPI_MCA_mpi_yield_when_idle=1"
# Open MPI 5 mpirun refuses to bind 4 ranks to 2 real cores
[ -n "${PRTE_MCA_hwloc_default_binding_policy:-}" ] || echo "export PRTE_MCA_hwloc_default_binding_policy=none"
[ -n "${OMPI_ALLOW_RUN_AS_ROOT:-}" ] || echo "export OMPI_ALLOW_RUN_AS_ROOT=1"
[ -n "${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-}" ] || echo "export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
exit 0
EOF
changed=0
for pair in "slurm.conf.new:$CONF_DIR/slurm.conf" "mpi.conf.new:$CONF_DIR/mpi.conf" "task_prolog.sh.new:$BASE/task_prolog.sh"; do
  src=$BASE/${pair%%:*} dst=${pair#*:}
  if ! cmp -s "$src" "$dst"; then mv "$src" "$dst"; changed=1; else rm -f "$src"; fi
done
chmod 644 "$CONF_DIR/slurm.conf" "$CONF_DIR/mpi.conf"; chmod 755 "$BASE/task_prolog.sh"
[ "$changed" = 1 ] && log "config written to $CONF_DIR/slurm.conf" || log "config unchanged"

stop_ours() { # NAME: stop a daemon we started earlier (pid file in $RUN)
  local pf=$RUN/$1.pid pid
  alive "$pf" "$1" || { rm -f "$pf"; return 0; }
  pid=$(cat "$pf"); kill -TERM "$pid"
  for ((i = 0; i < 100; i++)); do alive "$pf" "$1" || break; sleep 0.1; done
  alive "$pf" "$1" && kill -KILL "$pid"
  rm -f "$pf"; log "stopped $1 (pid $pid) for restart"
}
if [ "$changed" = 1 ]; then stop_ours slurmd; stop_ours slurmctld; fi

# ---------------------------------------------------------------- 4. munged
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "munged already working$(alive "$RUN/munged.pid" munged && echo " (ours, pid $(cat "$RUN/munged.pid"))" || echo " (not started by us; left alone)")"
else
  install -d -o munge -g munge -m 0755 /run/munge
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged       # daemonizes; writes /run/munge/munged.pid
  wait_for 10 test -s /run/munge/munged.pid || die "munged did not write its pid file (see /var/log/munge/munged.log)"
  cp /run/munge/munged.pid "$RUN/munged.pid"
  wait_for 10 sh -c 'munge -n | unmunge' || die "munge round trip fails"
  log "munged started (pid $(cat "$RUN/munged.pid"))"
fi

# ---------------------------------------------------------------- 5. slurmctld, slurmd
if alive "$RUN/slurmctld.pid" slurmctld; then
  log "slurmctld already running (pid $(cat "$RUN/slurmctld.pid"))"
else
  scontrol ping 2>/dev/null | grep -q 'is UP' && die "a slurmctld not started by this script answers on this config's port"
  rm -f "$RUN/slurmctld.pid"
  msg=$(clean_stale_mpi_shm); [ -z "$msg" ] || log "$msg"
  slurmctld -c                                # -c: start with clean state (no stale jobs); daemonizes
  wait_for 20 alive "$RUN/slurmctld.pid" slurmctld || die "slurmctld did not start"
  wait_for 20 sh -c 'scontrol ping | grep -q "is UP"' || die "slurmctld does not answer"
  log "slurmctld started (pid $(cat "$RUN/slurmctld.pid"))"
fi
if alive "$RUN/slurmd.pid" slurmd; then
  log "slurmd already running (pid $(cat "$RUN/slurmd.pid"))"
else
  rm -f "$RUN/slurmd.pid"
  slurmd -N "$HOST"                           # daemonizes
  wait_for 20 alive "$RUN/slurmd.pid" slurmd || die "slurmd did not start"
  log "slurmd started (pid $(cat "$RUN/slurmd.pid"))"
fi

# ---------------------------------------------------------------- 6. wait for the node
node_idle() {
  local st; st=$(sinfo -h -n "$HOST" -o '%T' 2>/dev/null) || return 1
  case $st in
    idle) return 0 ;;
    down*|drain*|fail*) scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1; return 1 ;;
    *) return 1 ;;
  esac
}
wait_for 60 node_idle || die "node $HOST not idle: $(sinfo -h -n "$HOST" -o '%T %E' 2>&1)"
log "node $HOST idle"
sinfo
if [ "$SMOKE" = 1 ]; then
  timeout 60 srun -n 4 true || die "smoke test 'srun -n 4 true' failed"
  log "smoke test 'srun -n 4 true' ok"
fi
log "cluster up: slurmctld=$(cat "$RUN/slurmctld.pid") slurmd=$(cat "$RUN/slurmd.pid") munged=$(cat "$RUN/munged.pid" 2>/dev/null || echo not-ours); logs in $LOG"
