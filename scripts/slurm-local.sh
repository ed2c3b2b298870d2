#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for tests/test_slurm_profile.py (and for trying the
# workflow/profiles/slurm profile by hand). Needs root and Debian (apt-get); idempotent: a second call with
# the cluster already up only waits for the node to be idle.
#
#   scripts/slurm-local.sh          # install (if missing), configure, start, wait for `sinfo` idle
#   scripts/slurm-local.sh stop     # stop slurmd, slurmctld, slurmdbd, MariaDB, munged (started here)
#
# Accounting: the slurm executor plugin polls `sacct` for job states, and the test proves every job went
# through sbatch by finding its id in `sacct`. With AccountingStorageType=none, Debian's 22.05 sacct answers
# "Slurm accounting storage is disabled" (measured), so this script runs slurmdbd on a local MariaDB — the
# one storage slurmdbd 22.05 offers (accounting_storage/mysql; no sqlite backend exists).
# Exit codes: 0 up; 3 slurmctld/slurmd did not come up (message on stderr names why); other: install failed.
set -euo pipefail

STATE=${KMESH_SLURM_STATE:-/var/lib/kmesh-slurm}     # our logs, pid files, spool (kept apart from Debian's)
CONF=/etc/slurm
HOST=$(hostname -s)
CLUSTER=kmesh
log() { echo "[slurm-local] $*" >&2; }
t0=$SECONDS

# kill the process a pid file names and wait (up to 30 s) until it is gone: a restart right after must not meet it
stop_pid() {
  local pid
  [[ -f $1 ]] || return 0
  pid=$(cat "$1"); kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  rm -f "$1"
}
stop() {
  for d in slurmd slurmctld slurmdbd; do stop_pid "$STATE/$d.pid"; done   # each daemon writes its pid file there
  stop_pid "$STATE/mysqld/mariadb.pid"
  stop_pid "$STATE/munged.pid"
}
[[ ${1:-} == stop ]] && { stop; exit 0; }

if [[ $(id -u) -ne 0 ]]; then log "needs root (apt-get, /etc/slurm, daemons)"; exit 3; fi

idle() { sinfo -h -n "$HOST" -o %t 2>/dev/null | grep -qx idle; }
node_cpus() { sinfo -h -n "$HOST" -o %c 2>/dev/null | head -n 1; }
HW_CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
if command -v sinfo >/dev/null && idle && sacct -n -X -o JobID --starttime now-1minutes >/dev/null 2>&1; then
  if [[ $(node_cpus) == "$HW_CPUS" ]]; then
    log "cluster already up (node $HOST idle, $HW_CPUS CPUs, sacct answers)"; exit 0
  fi
  # a cluster configured with other CPUs than this machine has (an earlier run's mistake): configure it again
  log "cluster up but node $HOST has $(node_cpus) CPUs configured, $HW_CPUS here: restarting it"
  stop
fi

pkgs=(slurm-wlm munge slurmdbd mariadb-server)
missing=()
for p in "${pkgs[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
log "packages ready after $((SECONDS - t0)) s"

mkdir -p "$STATE"/{spool/ctld,spool/d,log,mysql,mysqld} /run/munge
chown munge:munge /run/munge; chown mysql:mysql "$STATE/mysql" "$STATE/mysqld"

# --- munge (authentication between the SLURM daemons and clients)
[[ -s /etc/munge/munge.key ]] || { mungekey --create --keyfile /etc/munge/munge.key; chown munge:munge /etc/munge/munge.key; }
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
  cp /run/munge/munged.pid "$STATE/munged.pid"
fi

# --- MariaDB for slurmdbd (a private datadir and socket: does not touch a system database)
SOCK=$STATE/mysqld/mysqld.sock
if ! mysqladmin --socket="$SOCK" ping >/dev/null 2>&1; then
  [[ -d $STATE/mysql/mysql ]] || mariadb-install-db --user=mysql --datadir="$STATE/mysql" --skip-test-db >/dev/null
  # detached, its output in its own log: a caller piping this script's output must not wait for MariaDB
  setsid runuser -u mysql -- /usr/sbin/mariadbd --datadir="$STATE/mysql" --socket="$SOCK" --skip-networking \
      --pid-file="$STATE/mysqld/mariadb.pid" --log-error="$STATE/mysqld/mariadb.err" \
      </dev/null >>"$STATE/log/mariadb.out" 2>&1 &
  for _ in $(seq 1 60); do mysqladmin --socket="$SOCK" ping >/dev/null 2>&1 && break; sleep 0.5; done
  mysqladmin --socket="$SOCK" ping >/dev/null 2>&1 || { log "MariaDB did not start:"; tail -n 5 "$STATE/mysqld/mariadb.err" >&2; exit 3; }
  mysql --socket="$SOCK" -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;"
fi

# --- configuration: this machine as one node; cores/memory as measured now. Not plain `nproc`: it honours
# OMP_NUM_THREADS, and make test exports OMP_NUM_THREADS=1 -> a 1-CPU node on which the profile's 2-CPU jobs pend
# for ever (CI at 861b90a). The CPUs this process may run on are what slurmd itself finds.
CPUS=$HW_CPUS
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
cat > "$CONF/slurmdbd.conf" <<EOF
# written by scripts/slurm-local.sh
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
# slurmdbd runs as root and MariaDB authenticates root@localhost by its unix socket (no password to keep)
StorageUser=root
StoragePort=3306
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/slurmdbd.pid
EOF
# slurmdbd reaches MariaDB through its socket (networking is off): libmysqlclient reads MYSQL_UNIX_PORT.
chmod 600 "$CONF/slurmdbd.conf"
cat > "$CONF/slurm.conf" <<EOF
# written by scripts/slurm-local.sh: a single-node test cluster on $HOST
ClusterName=$CLUSTER
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
# no systemd/cgroup delegation in containers: track processes by /proc, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/slurmdbd
# keep sbatch --comment (the slurm plugin puts the rule name there) in sacct
AccountingStoreFlags=job_comment
AccountingStorageHost=localhost
JobCompType=jobcomp/none
ReturnToService=2
SlurmdTimeout=60
MinJobAge=300
# a job that names no memory gets this much per CPU, not the whole node
DefMemPerCPU=1000
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=main Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
# No cgroup.conf: slurmd 22.05 always loads a cgroup plugin and refuses CgroupPlugin=disabled (measured);
# autodetect works here and nothing uses it (proctrack/linuxproc, task/none).

export MYSQL_UNIX_PORT=$SOCK
running() { [[ -f $STATE/$1.pid ]] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null; }
running slurmdbd || /usr/sbin/slurmdbd </dev/null >/dev/null 2>&1
for _ in $(seq 1 60); do sacctmgr -n -i list cluster >/dev/null 2>&1 && break; sleep 0.5; done
sacctmgr -n -i list cluster >/dev/null 2>&1 || { log "slurmdbd did not answer:"; tail -n 5 "$STATE/log/slurmdbd.log" >&2; exit 3; }
sacctmgr -n list cluster format=cluster 2>/dev/null | grep -qw "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
running slurmctld || /usr/sbin/slurmctld </dev/null >/dev/null 2>&1
running slurmd || /usr/sbin/slurmd </dev/null >/dev/null 2>&1
for _ in $(seq 1 120); do idle && break; sleep 0.5; done
if ! idle; then
  log "slurmctld/slurmd did not bring node $HOST to idle after $((SECONDS - t0)) s; last log lines:"
  tail -n 5 "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" >&2 2>/dev/null || true
  exit 3
fi
# the first `sacct` after a fresh registration can lag; wait until it answers
for _ in $(seq 1 60); do sacct -n -X -o JobID --starttime now-1minutes >/dev/null 2>&1 && break; sleep 0.5; done
log "cluster up: node $HOST idle ($CPUS CPUs, $MEM_MB MB), sacct via slurmdbd; $((SECONDS - t0)) s"
