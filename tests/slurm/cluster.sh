#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the `slurm`-marked tests (tests/runner/test_slurm.py) and CI.
#
#   tests/slurm/cluster.sh start    # install (once), write the configs, start every daemon, wait until usable
#   tests/slurm/cluster.sh stop     # stop the daemons this script started (by pid), keep nothing running
#   tests/slurm/cluster.sh status   # exit 0 when the cluster answers
#
# Needs root (Debian packages, daemons running as root) and no systemd: every daemon is started by hand.
# Every start is clean: the controller's state, the node's spool and the accounting database are created
# anew, so no job or accounting row of an earlier run survives; a start that fails stops the daemons it
# had started (exit status non-zero, the logs' tails printed). The node is this host with its `nproc`
# CPUs and SPECSAMP_SLURM_MEM_SHARE percent (default 50) of its memory, in partition `debug`; memory is
# a consumable resource (select/cons_tres, CR_Core_Memory) and enforced by polling (jobacct_gather/linux
# with OverMemoryKill, every second), so a job above its --mem is killed and recorded as OUT_OF_MEMORY.
# State lives in SPECSAMP_SLURM_DIR (default /tmp/specsamp-slurm); the configs are written where the
# Debian commands look for them (/etc/slurm), so sbatch, squeue, sacct work without SLURM_CONF.
set -euo pipefail

D=${SPECSAMP_SLURM_DIR:-/tmp/specsamp-slurm}
SHARE=${SPECSAMP_SLURM_MEM_SHARE:-50}
ETC=/etc/slurm
DB_PORT=${SPECSAMP_SLURM_DB_PORT:-3317}
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
DAEMONS=(slurmd slurmctld slurmdbd mariadbd munged)   # stop order

log() { echo "cluster.sh: $*" >&2; }

install_packages() {
    local missing=()
    for c in slurmctld slurmd sbatch munged slurmdbd mariadbd; do
        command -v "$c" >/dev/null 2>&1 || [ -x "/usr/sbin/$c" ] || missing+=("$c")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "installing ${PACKAGES[*]} (missing: ${missing[*]})"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${PACKAGES[@]}" >/dev/null
}

pid_of() { [ -s "$D/$1.pid" ] && cat "$D/$1.pid" 2>/dev/null || true; }

alive() { local p; p=$(pid_of "$1"); [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }

stop_one() {
    local name=$1 p i
    p=$(pid_of "$name")
    if [ -n "$p" ] && kill -0 "$p" 2>/dev/null; then
        kill "$p" 2>/dev/null || true
        for i in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$p" 2>/dev/null && kill -9 "$p" 2>/dev/null || true
    fi
    rm -f "$D/$name.pid"
}

stop() {
    local name
    for name in "${DAEMONS[@]}"; do stop_one "$name"; done
    log "stopped"
}

wait_for() {  # wait_for SECONDS WHAT CMD...: poll CMD every 0.5 s
    local limit=$1 what=$2 i
    shift 2
    for i in $(seq 1 $((limit * 2))); do
        if timeout 15 "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.5
    done
    log "$what did not come up within ${limit}s; logs in $D/log"
    tail -n 20 "$D"/log/*.log >&2 || true
    exit 3
}

write_configs() {
    local host cpus mem_mb
    host=$(hostname -s)
    cpus=$(nproc)
    mem_mb=$(awk -v s="$SHARE" '/^MemTotal:/ {printf "%d", $2 / 1024 * s / 100}' /proc/meminfo)
    mkdir -p "$ETC"
    cat >"$ETC/slurm.conf" <<EOF
# written by tests/slurm/cluster.sh: one node ($host), partition debug
ClusterName=specsamp
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# job credentials live 20 s (default 120): a requeued job becomes eligible again that much sooner
AuthInfo=cred_expire=20
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=512
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=1
JobAcctGatherParams=OverMemoryKill
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
JobCompType=jobcomp/none
ReturnToService=2
MpiDefault=none
KillWait=5
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
MaxArraySize=10001
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$ETC/slurmdbd.conf" <<EOF
# written by tests/slurm/cluster.sh
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
PidFile=$D/slurmdbd.pid
LogFile=$D/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=specsamp
StorageLoc=slurm_acct_db
EOF
    # slurmdbd refuses a slurmdbd.conf not owned by its SlurmUser (root here): an existing file keeps its
    # owner when rewritten (the slurmdbd package's, for one), so set it
    chown root:root "$ETC/slurm.conf" "$ETC/slurmdbd.conf"
    chmod 600 "$ETC/slurmdbd.conf"
}

failed_start() {  # EXIT trap of start: a start that fails stops what it started (munged, MariaDB, ...)
    local rc=$?
    trap - EXIT
    if [ "$rc" -ne 0 ]; then
        log "start failed (exit $rc): stopping the daemons it started; logs in $D/log"
        stop >/dev/null 2>&1 || true
    fi
    exit "$rc"
}

start() {
    install_packages
    stop >/dev/null 2>&1 || true
    rm -rf "$D"
    mkdir -p "$D"/{state,spool,log,munge,mysql}
    trap failed_start EXIT
    chmod 711 "$D/munge"
    mkdir -p /run/munge && chmod 755 /run/munge
    write_configs

    # munge: a key of this cluster's own
    mungekey --create --keyfile="$D/munge/munge.key" --force >/dev/null 2>&1 \
        || dd if=/dev/urandom of="$D/munge/munge.key" bs=1 count=1024 status=none
    chmod 400 "$D/munge/munge.key"
    munged --force --key-file="$D/munge/munge.key" --socket=/run/munge/munge.socket.2 \
        --pid-file="$D/munged.pid" --log-file="$D/log/munged.log" --seed-file="$D/munge/munge.seed"
    wait_for 20 munged munge -n

    # MariaDB on its own data directory and port, for slurmdbd only
    mariadb-install-db --user=root --datadir="$D/mysql" --auth-root-authentication-method=socket \
        --skip-test-db >"$D/log/mariadb-install.log" 2>&1
    mariadbd --user=root --datadir="$D/mysql" --socket="$D/mysql.sock" --port="$DB_PORT" \
        --bind-address=127.0.0.1 --pid-file="$D/mariadbd.pid" --log-error="$D/log/mariadb.log" \
        --innodb-buffer-pool-size=32M --skip-log-bin >/dev/null 2>&1 &
    echo $! >"$D/mariadbd.pid"  # before it writes its own (the same pid), so that a failed start can stop it
    wait_for 60 MariaDB mariadb --socket="$D/mysql.sock" -e "select 1"
    mariadb --socket="$D/mysql.sock" -e "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'specsamp';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"

    slurmdbd
    wait_for 60 slurmdbd sacctmgr -n list cluster
    sacctmgr -i add cluster specsamp >/dev/null 2>&1 || true
    slurmctld -i
    wait_for 60 slurmctld scontrol ping
    slurmd
    wait_for 60 "the node (idle in sinfo)" sh -c 'sinfo -h -N -o %T | grep -qx idle'
    wait_for 60 "srun hostname" timeout 20 srun -N1 -n1 -t 1 hostname
    trap - EXIT
    log "up: $(sinfo -h -N -o '%N %T %c CPUs %m MB' | head -1), partition debug; state in $D"
}

status() {
    alive slurmctld && alive slurmd && alive slurmdbd && scontrol ping >/dev/null 2>&1
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
