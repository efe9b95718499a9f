#!/usr/bin/env bash
# scripts/slurm/down.sh - stop exactly the daemons scripts/slurm/up.sh started.
#
# Reads "<name> <pid>" lines from $SLURM_LOCAL_DIR/daemons.pids. A PID is only
# signalled if /proc/<pid>/comm still equals <name> (guards against PID reuse).
# Before stopping slurmd it cancels the jobs still in the local cluster, so no
# slurmstepd / job processes are left behind. No pkill/killall by name.
# State (job ids, accounting DB, configs) is kept, so the next setup resumes.
set -uo pipefail

BASE=${SLURM_LOCAL_DIR:-/var/spool/slurm-local}
PIDREC=$BASE/daemons.pids
log() { echo "[slurm-local-teardown] $*" >&2; }
# alive PID: exists and is not a zombie
alive() { kill -0 "$1" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }

[ -s "$PIDREC" ] || { log "nothing recorded in $PIDREC; nothing to stop"; exit 0; }

ours() {  # ours NAME -> pid if recorded and still that program
  local p
  p=$(awk -v n="$1" '$1==n{print $2}' "$PIDREC")
  [ -n "$p" ] && [ -r "/proc/$p/comm" ] && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$1" ] \
    && [ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" != Z ] && echo "$p"
}

# 1. cancel remaining jobs while slurmctld/slurmd are still up (only if the controller is ours)
if [ -n "$(ours slurmctld)" ] && [ -n "$(ours slurmd)" ]; then
  jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    log "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 1 60); do
      [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
fi

# 2. stop daemons in reverse dependency order
rc=0
for name in slurmd slurmctld slurmdbd mariadbd munged; do
  p=$(ours "$name") || true
  if [ -z "$p" ]; then
    grep -q "^$name " "$PIDREC" && log "$name: recorded pid no longer running"
    continue
  fi
  kill -TERM "$p" 2>/dev/null
  for _ in $(seq 1 120); do alive "$p" || break; sleep 0.25; done
  if alive "$p"; then
    log "$name (pid $p) ignored SIGTERM for 30 s; sending SIGKILL"
    kill -KILL "$p" 2>/dev/null; sleep 0.5
  fi
  if alive "$p"; then log "$name (pid $p) still alive!"; rc=1; else log "stopped $name (pid $p)"; fi
done
[ "$rc" = 0 ] && rm -f "$PIDREC"
exit "$rc"
