#!/usr/bin/env bash
# ci-cluster-down.sh - stop the daemons that ci-cluster-up.sh started, by the PIDs recorded
# in $SLURM_CI_BASE/run/*.pid (never by name): cancels this cluster's jobs first, then stops
# slurmd, slurmctld and (if ours) munged, then removes MPICH/Open MPI /dev/shm segments that
# no process uses (left by killed jobs). Daemons it did not start are left alone.
# SLURM_CI_WIPE=1 also deletes $SLURM_CI_BASE (state, spool, logs).
set -uo pipefail
BASE=${SLURM_CI_BASE:-/tmp/slurm-ci}
RUN=$BASE/run

alive() { # PIDFILE COMM
  local pid st
  [ -s "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$2" ] || return 1
  st=$(awk '{print $3}' /proc/"$pid"/stat 2>/dev/null) || return 1
  [ "$st" != Z ]
}
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
