# ci-cluster-lib.sh - shell functions shared by ci-cluster-up.sh and ci-cluster-down.sh
# (sourced, not run).

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
