#!/usr/bin/env bash
# scripts/slurm/up.sh - bring up a real single-node Slurm cluster on localhost.
#
# Idempotent: installs the Debian packages if missing, (re)writes the configs,
# starts munged / mariadbd / slurmdbd / slurmctld / slurmd only if they are not
# already running, waits until the node accepts jobs, then prints "slurm ready".
# Every daemon it starts is recorded as "<name> <pid>" in $SLURM_LOCAL_DIR/daemons.pids;
# scripts/slurm/down.sh stops exactly those PIDs.
#
# Tested on Debian 12 (bookworm), slurm-wlm 22.05.8, munge 0.5.15, MariaDB 10.11,
# no systemd, no usable cgroups, running as root.
#
# Knobs (environment):
#   SLURM_LOCAL_DIR=/var/spool/slurm-local  state, logs, pid files, pid record
#   SLURM_LOCAL_ACCOUNTING=1   1: slurmdbd + MariaDB, so `sacct` works (submitit polls
#                              sacct for job states; without it, state is UNKNOWN and a job
#                              that dies without a result pickle makes job.result() hang).
#                              0: no accounting, ~15 s less install time.
#   SLURM_LOCAL_AUTH=munge     munge | none  (munge falls back to none if munged won't start)
#   SLURM_LOCAL_CPUS=8         CPUs advertised for the node (v4launch default: 8, so several
#                              1-CPU test jobs run at once on a 2-core box). A number other
#                              than the real count from `slurmd -C` oversubscribes the machine
#                              (SlurmdParameters=config_overrides); empty = the real count.
#   SLURM_LOCAL_TIMEOUT=90     seconds to wait for each daemon / the node
#   SLURM_LOCAL_KEEP_JOBS=0    1: keep jobs recovered from saved state when slurmctld is
#                              (re)started; default cancels them (else Slurm re-runs them)
set -euo pipefail

BASE=${SLURM_LOCAL_DIR:-/var/spool/slurm-local}
ACCOUNTING=${SLURM_LOCAL_ACCOUNTING:-1}
AUTH=${SLURM_LOCAL_AUTH:-munge}
CPUS_WANTED=${SLURM_LOCAL_CPUS-8}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-90}
CLUSTER=localcluster
PARTITION=debug
NODE=$(hostname -s 2>/dev/null || true); NODE=${NODE:-localhost}
RUN=$BASE/run
LOG=$BASE/log
PIDREC=$BASE/daemons.pids
SLURM_CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
MUNGE_PID=/run/munge/munged.pid
MARIADB_PID=/run/mysqld/mariadbd-slurm-local.pid
DB_PASS=slurmlocal   # MariaDB runs with --skip-networking: unix socket only

T_START=$(date +%s)
log() { echo "[slurm-local +$(( $(date +%s) - T_START ))s] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ---------------------------------------------------------------- helpers
# alive PID: exists and is not a zombie
alive() { kill -0 "$1" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }
# pid_alive PIDFILE COMM -> prints pid if the file names a live process called COMM
pid_alive() {
  local f=$1 comm=$2 p
  [ -s "$f" ] || return 1
  p=$(tr -dc '0-9' < "$f")
  [ -n "$p" ] && [ -r "/proc/$p/comm" ] && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$comm" ] || return 1
  # a killed daemon can linger as a zombie until PID 1 reaps it
  [ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" != Z ] || return 1
  echo "$p"
}

# record NAME PID  (replace any previous line for NAME)
record() {
  mkdir -p "$BASE"
  touch "$PIDREC"
  { grep -v "^$1 " "$PIDREC" || true; echo "$1 $2"; } > "$PIDREC.tmp"
  mv "$PIDREC.tmp" "$PIDREC"
}
unrecord() { [ -f "$PIDREC" ] && { grep -v "^$1 " "$PIDREC" || true; } > "$PIDREC.tmp" && mv "$PIDREC.tmp" "$PIDREC" || true; }
recorded_pid() { [ -f "$PIDREC" ] && awk -v n="$1" '$1==n{print $2}' "$PIDREC" || true; }

# wait_until DESC CMD...  (retries CMD every 0.25 s until it succeeds or TIMEOUT)
wait_until() {
  local desc=$1; shift
  local deadline=$(( $(date +%s) + TIMEOUT ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.25
  done
  log "$desc"
}

# stop_ours NAME PIDFILE COMM  (only if the live pid is the one we recorded)
stop_ours() {
  local name=$1 f=$2 comm=$3 p
  p=$(pid_alive "$f" "$comm") || return 0
  [ "$p" = "$(recorded_pid "$name")" ] || { log "$name (pid $p) was not started by us; leaving it"; return 0; }
  log "restarting $name (pid $p) for new config"
  kill -TERM "$p" 2>/dev/null || true
  for _ in $(seq 1 120); do alive "$p" || break; sleep 0.25; done
  alive "$p" && kill -KILL "$p" 2>/dev/null || true
  unrecord "$name"
}

tail_log() { [ -f "$1" ] && { echo "---- tail $1"; tail -n 20 "$1"; } >&2 || true; }

# ---------------------------------------------------------------- 1. packages
PKGS=(slurmctld slurmd slurm-client)
[ "$AUTH" = munge ] && PKGS+=(munge)
[ "$ACCOUNTING" = 1 ] && PKGS+=(slurmdbd mariadb-server)
mkdir -p "$BASE/ctld" "$BASE/d" "$RUN" "$LOG"
MISSING=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || MISSING+=("$p")
done
if [ ${#MISSING[@]} -gt 0 ]; then
  log "installing: ${MISSING[*]}"
  # keep postinst scripts from starting daemons we would not own (no systemd here)
  TEMP_POLICY=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    TEMP_POLICY=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >"$LOG/apt.log" 2>&1 || { cat "$LOG/apt.log" >&2; die "apt-get update failed"; }
  apt-get install -y -qq --no-install-recommends "${MISSING[@]}" >>"$LOG/apt.log" 2>&1 \
    || { tail -n 30 "$LOG/apt.log" >&2; [ -n "$TEMP_POLICY" ] && rm -f /usr/sbin/policy-rc.d; die "apt-get install failed"; }
  [ -n "$TEMP_POLICY" ] && rm -f /usr/sbin/policy-rc.d
  log "packages installed ($(dpkg-query -W -f='${Version}' slurmctld))"
fi


# ---------------------------------------------------------------- 2. munge
munge_ok() { munge -n </dev/null | unmunge >/dev/null; }
if [ "$AUTH" = munge ]; then
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    mungekey -c -f -k /etc/munge/munge.key
  fi
  chown munge:munge /etc/munge /etc/munge/munge.key && chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge && chmod 755 /run/munge
  if munge_ok 2>/dev/null; then
    log "munged already running (pid $(pid_alive $MUNGE_PID munged || echo '?'))"
  else
    setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --pid-file=$MUNGE_PID \
      --log-file=/var/log/munge/munged.log 2>>"$LOG/munged.start.log" || true
    if wait_until "munged up" munge_ok && p=$(pid_alive $MUNGE_PID munged); then
      record munged "$p"
    else
      tail_log /var/log/munge/munged.log; tail_log "$LOG/munged.start.log"
      log "munged failed to start; falling back to AuthType=auth/none"
      AUTH=none
    fi
  fi
fi
if [ "$AUTH" = munge ]; then AUTHTYPE=auth/munge; CREDTYPE=cred/munge; else AUTHTYPE=auth/none; CREDTYPE=cred/none; fi

# ---------------------------------------------------------------- 3. configs
# Node hardware as slurmd sees it, e.g.
# NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105
HW=$(slurmd -C | head -n1)
hw() { sed -n "s/.*[[:space:]]$1=\([0-9]*\).*/\1/p" <<<"$HW"; }
REAL_CPUS=$(hw CPUs); REALMEM=$(hw RealMemory)
[ -n "$REAL_CPUS" ] && [ -n "$REALMEM" ] || die "cannot parse 'slurmd -C': $HW"
MEM=$(( REALMEM * 95 / 100 ))            # a bit under the real value, so the node never drains for "Low RealMemory"
if [ -n "$CPUS_WANTED" ] && [ "$CPUS_WANTED" != "$REAL_CPUS" ]; then
  NODE_HW="CPUs=$CPUS_WANTED"
  OVERRIDES="SlurmdParameters=config_overrides"
  NCPU=$CPUS_WANTED
else
  NODE_HW="CPUs=$REAL_CPUS Boards=$(hw Boards) SocketsPerBoard=$(hw SocketsPerBoard) CoresPerSocket=$(hw CoresPerSocket) ThreadsPerCore=$(hw ThreadsPerCore)"
  OVERRIDES=
  NCPU=$REAL_CPUS
fi
if [ "$ACCOUNTING" = 1 ]; then
  ACCT="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819"
else
  ACCT="AccountingStorageType=accounting_storage/none"
fi

mkdir -p /etc/slurm
NEW_CONF=$(cat <<EOF
# generated by scripts/slurm/up.sh - single-node localhost cluster
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=$AUTHTYPE
CredType=$CREDTYPE
# requeued jobs wait cred_expire seconds before they may start again (default 120)
AuthInfo=cred_expire=10
MpiDefault=none
SwitchType=switch/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
$ACCT
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$(( MEM / NCPU ))
SchedulerType=sched/backfill
# re-scan pending jobs every 2 s (default 60/30 s): requeued jobs restart promptly
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
JobRequeue=1
MailProg=/bin/true
StateSaveLocation=$BASE/ctld
SlurmdSpoolDir=$BASE/d
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
# seconds between SIGTERM and SIGKILL: a v4launch job finishes its step and saves a checkpoint in them
KillWait=30
MinJobAge=300
Waittime=0
$OVERRIDES
NodeName=$NODE NodeAddr=127.0.0.1 $NODE_HW RealMemory=$MEM State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
)
SLURM_CONF_CHANGED=0
if [ "$(cat "$SLURM_CONF" 2>/dev/null)" != "$NEW_CONF" ]; then
  printf '%s\n' "$NEW_CONF" > "$SLURM_CONF"; chmod 644 "$SLURM_CONF"
  SLURM_CONF_CHANGED=1; log "wrote $SLURM_CONF"
fi

DBD_CONF_CHANGED=0
if [ "$ACCOUNTING" = 1 ]; then
  NEW_DBD=$(cat <<EOF
# generated by scripts/slurm/up.sh
AuthType=$AUTHTYPE
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
)
  if [ "$(cat "$DBD_CONF" 2>/dev/null)" != "$NEW_DBD" ]; then
    printf '%s\n' "$NEW_DBD" > "$DBD_CONF"; DBD_CONF_CHANGED=1; log "wrote $DBD_CONF"
  fi
  chmod 600 "$DBD_CONF"   # slurmdbd refuses a world-readable config holding a password
fi

# config changed under running daemons that we own -> restart them (slurmd first)
if [ "$SLURM_CONF_CHANGED" = 1 ]; then
  stop_ours slurmd "$RUN/slurmd.pid" slurmd
  stop_ours slurmctld "$RUN/slurmctld.pid" slurmctld
fi
[ "$DBD_CONF_CHANGED" = 1 ] && stop_ours slurmdbd "$RUN/slurmdbd.pid" slurmdbd

# ---------------------------------------------------------------- 4. MariaDB + slurmdbd
if [ "$ACCOUNTING" = 1 ]; then
  mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
  if [ ! -d /var/lib/mysql/mysql ]; then
    log "initialising MariaDB datadir"
    mkdir -p /var/lib/mysql && chown mysql:mysql /var/lib/mysql
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >"$LOG/mariadb-install.log" 2>&1 \
      || { tail_log "$LOG/mariadb-install.log"; die "mariadb-install-db failed"; }
  fi
  if mariadb-admin ping >/dev/null 2>&1; then
    log "mariadbd already running (pid $(pid_alive $MARIADB_PID mariadbd || echo 'not ours'))"
  else
    # mariadbd does not fork: background it; it writes its own pid file
    nohup /usr/sbin/mariadbd --user=mysql --skip-networking --pid-file=$MARIADB_PID \
      --log-error="$LOG/mariadb.log" --innodb-buffer-pool-size=128M \
      --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
    wait_until "mariadbd up" mariadb-admin ping || { tail_log "$LOG/mariadb.log"; die "mariadbd did not start"; }
    p=$(pid_alive $MARIADB_PID mariadbd) || die "mariadbd pid file missing"
    record mariadbd "$p"
  fi
  mariadb <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
EOF
  if p=$(pid_alive "$RUN/slurmdbd.pid" slurmdbd); then
    log "slurmdbd already running (pid $p)"
  else
    /usr/sbin/slurmdbd || { tail_log "$LOG/slurmdbd.log"; die "slurmdbd failed to start"; }
    wait_until "slurmdbd up" sacctmgr -n show cluster || { tail_log "$LOG/slurmdbd.log"; die "slurmdbd not answering"; }
    p=$(pid_alive "$RUN/slurmdbd.pid" slurmdbd) || die "slurmdbd pid file missing"
    record slurmdbd "$p"
  fi
  if ! sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null && log "registered cluster $CLUSTER in slurmdbd"
  fi
fi

# ---------------------------------------------------------------- 5. slurmctld + slurmd
ctld_ok() { scontrol ping | grep -q 'is UP'; }
if p=$(pid_alive "$RUN/slurmctld.pid" slurmctld); then
  log "slurmctld already running (pid $p)"
  wait_until "slurmctld answering" ctld_ok || die "slurmctld pid $p is alive but not answering; see $LOG/slurmctld.log"
else
  /usr/sbin/slurmctld || { tail_log "$LOG/slurmctld.log"; die "slurmctld failed to start"; }
  wait_until "slurmctld up" ctld_ok || { tail_log "$LOG/slurmctld.log"; die "slurmctld not answering"; }
  p=$(pid_alive "$RUN/slurmctld.pid" slurmctld) || die "slurmctld pid file missing"
  record slurmctld "$p"
  # Jobs recovered from StateSaveLocation belong to an earlier, killed incarnation
  # (e.g. a previous session/CI run): cancel them, or Slurm would re-run them.
  if [ "${SLURM_LOCAL_KEEP_JOBS:-0}" != 1 ] && [ -z "$(pid_alive "$RUN/slurmd.pid" slurmd || true)" ]; then
    stale=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
    if [ -n "${stale// /}" ]; then
      log "cancelling jobs left over from a previous run: $stale"
      # shellcheck disable=SC2086
      scancel $stale || true
    fi
  fi
fi

SLURMD_T0=
if p=$(pid_alive "$RUN/slurmd.pid" slurmd); then
  log "slurmd already running (pid $p)"
else
  SLURMD_T0=$(date +%Y-%m-%dT%H:%M:%S)
  /usr/sbin/slurmd -N "$NODE" || { tail_log "$LOG/slurmd.log"; die "slurmd failed to start"; }
  wait_until "slurmd up" pid_alive "$RUN/slurmd.pid" slurmd || { tail_log "$LOG/slurmd.log"; die "slurmd died"; }
  p=$(pid_alive "$RUN/slurmd.pid" slurmd) || die "slurmd pid file missing"
  record slurmd "$p"
fi

# ---------------------------------------------------------------- 6. node usable?
node_ready() {
  local st t
  if [ -n "$SLURMD_T0" ]; then   # we (re)started slurmd: wait until it has registered with slurmctld
    t=$(scontrol -o show node "$NODE" 2>/dev/null | sed -n 's/.*SlurmdStartTime=\([^ ]*\).*/\1/p')
    [[ "$t" > "$SLURMD_T0" || "$t" == "$SLURMD_T0" ]] || return 1
  fi
  st=$(sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n1)
  case "$st" in
    idle|mixed|allocated|completing) return 0 ;;
    down|drained|draining|drain) scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true; return 1 ;;
    *) return 1 ;;   # unknown*, down*, not responding yet
  esac
}
wait_until "node $NODE usable" node_ready \
  || { sinfo -N -l >&2 || true; tail_log "$LOG/slurmd.log"; tail_log "$LOG/slurmctld.log"; die "node $NODE never became usable"; }

log "daemons: $(tr '\n' ' ' < "$PIDREC" 2>/dev/null)(auth=$AUTHTYPE accounting=$ACCOUNTING cpus=$NCPU)"
sinfo
echo "slurm ready"
