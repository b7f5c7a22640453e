#!/usr/bin/env bash
# ci-cluster-down.sh - stop the daemons that ci-cluster-up.sh started, by the PIDs recorded
# in $SLURM_CI_BASE/run/*.pid (never by name): cancels this cluster's jobs first, then stops
# slurmd, slurmctld and (if ours) munged, then removes MPICH/Open MPI /dev/shm segments that
# no process uses (left by killed jobs). Daemons it did not start are left alone.
# SLURM_CI_WIPE=1 also deletes $SLURM_CI_BASE (state, spool, logs).
set -uo pipefail
BASE=${SLURM_CI_BASE:-/tmp/slurm-ci}
RUN=$BASE/run

source "$(dirname "${BASH_SOURCE[0]}")/ci-cluster-lib.sh"  # alive, clean_stale_mpi_shm
stop() { # NAME: TERM the pid in $RUN/NAME.pid, wait up to 10 s, then KILL
  local name=$1 pf=$RUN/$1.pid pid
  if [ ! -e "$pf" ]; then echo "$name: no pid file, not started by ci-cluster-up.sh - left alone"; return 0; fi
  pid=$(cat "$pf" 2>/dev/null)
  if alive "$pf" "$name"; then
    kill -TERM "$pid"
    for ((i = 0; i < 100; i++)); do alive "$pf" "$name" || break; sleep 0.1; done
    if alive "$pf" "$name"; then kill -KILL "$pid"; echo "$name: pid $pid killed (SIGKILL)"; else echo "$name: pid $pid stopped"; fi
  else
    echo "$name: pid ${pid:-?} not running"
  fi
  rm -f "$pf"
}


# cancel jobs of this cluster while the controller is still ours and up
if alive "$RUN/slurmctld.pid" slurmctld; then
  jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    echo "cancelling jobs: $jobs"
    scancel $jobs 2>/dev/null
    for ((i = 0; i < 100; i++)); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi
stop slurmd
stop slurmctld
if [ -e "$RUN/munged.pid" ]; then
  stop munged
  rm -f /run/munge/munged.pid
else
  echo "munged: not started by ci-cluster-up.sh - left alone"
fi
clean_stale_mpi_shm
# step daemons of finished jobs exit on their own within a moment (zombies do not count)
stepds() { for p in /proc/[0-9]*; do [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] \
             && [ "$(awk '{print $3}' "$p/stat" 2>/dev/null)" != Z ] && echo "${p#/proc/}"; done | tr '\n' ' '; }
for ((i = 0; i < 25; i++)); do left=$(stepds); [ -z "${left// /}" ] && break; sleep 0.2; done
[ -n "${left// /}" ] && echo "warning: slurmstepd processes still running (pids: $left)"
if [ "${SLURM_CI_WIPE:-0}" = 1 ]; then rm -rf "$BASE"; echo "removed $BASE"; fi
exit 0
