# shellcheck shell=bash
# Throwaway PostgreSQL 15, MariaDB 10.11, Redis, memcached and RabbitMQ servers for the tests and
# benchmarks (sourced,
# not executed). Requires common.sh to be sourced first. Root only: the servers run as the
# postgres and mysql users, which the Debian packages create.
#
# Defines:
#   nb_databases_ensure_packages  install the server packages and client libraries if missing
#   nb_databases_start            start both servers in a fresh temporary directory and export
#                                 the variables below; call it in the main shell (not in a
#                                 subshell), with nb_databases_stop in an EXIT trap
#   nb_databases_stop             stop both servers and remove the directory; idempotent,
#                                 never fails, safe in an EXIT trap
#
# Exported by nb_databases_start (TCP on 127.0.0.1 only, so the Ruby 3.3 chroot reaches them:
# it shares the host's network, not its /tmp):
#   NEVERBLOCK_PG_HOST NEVERBLOCK_PG_PORT NEVERBLOCK_PG_USER NEVERBLOCK_PG_PASSWORD
#   NEVERBLOCK_PG_DATABASE        role neverblock (superuser), database neverblock_test
#   NEVERBLOCK_PG_BIN             host directory of pg_ctl, psql, ... (not valid in the chroot)
#   NEVERBLOCK_MYSQL_HOST NEVERBLOCK_MYSQL_PORT NEVERBLOCK_MYSQL_USER NEVERBLOCK_MYSQL_PASSWORD
#   NEVERBLOCK_MYSQL_DATABASE     user neverblock (ALL PRIVILEGES on *.*, so it may KILL),
#                                 database neverblock_test
#   NEVERBLOCK_REDIS_URL          redis://127.0.0.1:PORT/0 (no password, nothing saved to disk)
#   NEVERBLOCK_MEMCACHED_SERVER   127.0.0.1:PORT (64 MB, no UDP)
#   NEVERBLOCK_AMQP_URL           amqp://guest:guest@127.0.0.1:PORT (RabbitMQ, no plugins; guest may
#                                 log in from 127.0.0.1 only)
#
# NEVERBLOCK_DATABASES=external: start nothing and use the servers that the NEVERBLOCK_PG_* and
# NEVERBLOCK_MYSQL_* variables and NEVERBLOCK_REDIS_URL, already exported, describe (e.g. a
# development server). NEVERBLOCK_MEMCACHED_SERVER and NEVERBLOCK_AMQP_URL are optional there: the
# compatibility tests of dalli and bunny (test/compat) fail, saying so, without them.
#
# The servers are fast and unsafe (fsync off), 300 connections each (benchmarks open many).
# PostgreSQL asks for a password over TCP (scram-sha-256; the tests check that a wrong one is
# refused) and trusts its Unix socket. Each server runs under a supervisor that starts it again
# whenever it exits, until nb_databases_stop: a test stops PostgreSQL with SIGINT to its
# postmaster and waits for it to come back. Servers and supervisors run in sessions of their
# own, so a Ctrl-C at the terminal reaches the caller, whose trap stops them in order; a
# watchdog stops them if the caller dies without doing so (SIGKILL).
#
# Layout of the directory (mktemp -d, "neverblock-db.*" under $TMPDIR or /tmp):
#   pg/data  pg/postgres.log  pg/.s.PGSQL.<port>      owned by postgres
#   mysql/data  mysql/mysqld.log  mysql/mysqld.sock   owned by mysql
#   redis/redis.log  redis/redis.pid                   owned by redis
#   memcached/memcached.pid  memcached/memcached.out   owned by memcache
#   rabbitmq/  (HOME, mnesia/, log/, epmd.pid, rabbitmq.pid)  owned by rabbitmq
#   stop                                              present = supervisors stop restarting

NB_PG_BIN=/usr/lib/postgresql/15/bin
NB_DATABASE_PACKAGES=(postgresql-15 postgresql-contrib mariadb-server mariadb-client
                      libpq-dev libmariadb-dev redis-server memcached rabbitmq-server)
NB_DB_PASSWORD="${NB_DB_PASSWORD:-neverblock}"   # of the neverblock user on both servers
NB_DB_START_TIMEOUT=30                          # seconds for a server to accept connections
NB_DB_STOP_TIMEOUT=20                           # seconds for a clean shutdown before SIGKILL
NB_DB_DIR=""                                    # set while this shell's servers run

nb_databases_ensure_packages() {
  nb_apt_ensure "${NB_DATABASE_PACKAGES[@]}"
}

nb_databases_start() {
  case "${NEVERBLOCK_DATABASES:-}" in
    external) _nb_db_check_external; return 0 ;;
    "")       ;;
    *)        nb_die "NEVERBLOCK_DATABASES=$NEVERBLOCK_DATABASES: the only value is 'external'" ;;
  esac
  [[ $EUID -eq 0 ]] || nb_die "starting the test databases needs root (the servers run as postgres and mysql)"
  [[ -z "$NB_DB_DIR" ]] || nb_die "the test databases are already running in $NB_DB_DIR"
  [[ -x "$NB_PG_BIN/postgres" ]] || nb_die "no PostgreSQL 15 in $NB_PG_BIN; run bin/setup"
  command -v mariadbd >/dev/null || nb_die "no mariadbd; run bin/setup"
  command -v redis-server >/dev/null || nb_die "no redis-server; run bin/setup"
  command -v memcached >/dev/null || nb_die "no memcached; run bin/setup"
  [[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]] || nb_die "no rabbitmq-server; run bin/setup"

  NB_DB_DIR="$(mktemp -d "${TMPDIR:-/tmp}/neverblock-db.XXXXXX")"
  chmod 755 "$NB_DB_DIR"                # let postgres and mysql reach their subdirectories
  mkdir "$NB_DB_DIR/pg" "$NB_DB_DIR/mysql" "$NB_DB_DIR/redis" "$NB_DB_DIR/memcached" "$NB_DB_DIR/rabbitmq"
  chown postgres:postgres "$NB_DB_DIR/pg"
  chown mysql:mysql "$NB_DB_DIR/mysql"
  chown redis:redis "$NB_DB_DIR/redis"
  chown memcache:memcache "$NB_DB_DIR/memcached"
  chown rabbitmq:rabbitmq "$NB_DB_DIR/rabbitmq"
  chmod 700 "$NB_DB_DIR/pg"
  _nb_db_watchdog

  local pg_port mysql_port redis_port memcached_port amqp_port dist_port epmd_port
  read -r pg_port mysql_port redis_port memcached_port amqp_port dist_port epmd_port \
    < <(_nb_db_free_ports 7) || true
  [[ "$epmd_port" =~ ^[0-9]+$ ]] || nb_die "found no free TCP ports on 127.0.0.1"
  # RabbitMQ takes the longest to start (~6 s): it boots while the others do.
  _nb_rabbitmq_launch "$amqp_port" "$dist_port" "$epmd_port"
  _nb_pg_start "$pg_port"
  _nb_mysql_start "$mysql_port"
  _nb_redis_start "$redis_port"
  _nb_memcached_start "$memcached_port"
  _nb_rabbitmq_wait "$amqp_port"
}

nb_databases_stop() {
  local dir="$NB_DB_DIR"
  NB_DB_DIR=""
  [[ -n "$dir" && -d "$dir" ]] || return 0
  : >"$dir/stop" || true
  # The watchdog's work is done (unless this is the watchdog).
  local watchdog=""
  read -r watchdog 2>/dev/null <"$dir/watchdog.pid" || true
  [[ -z "$watchdog" || "$watchdog" == "$$" ]] || kill "$watchdog" 2>/dev/null || true

  # Fast shutdown: SIGINT for PostgreSQL (rolls back open transactions), SIGTERM for
  # MariaDB. Signalled again each second, in case a supervisor was restarting its server
  # (no pid file yet) when the stop file appeared.
  local deadline=$(( SECONDS + NB_DB_STOP_TIMEOUT )) tick=0
  while [[ -n "$(_nb_db_processes "$dir")" ]] && (( SECONDS < deadline )); do
    if (( tick++ % 10 == 0 )); then
      _nb_db_signal INT "$dir/pg/data/postmaster.pid"
      _nb_db_signal TERM "$dir/mysql/mysqld.pid"
      _nb_db_signal TERM "$dir/redis/redis.pid"
      _nb_db_signal TERM "$dir/memcached/memcached.pid"
      _nb_db_signal TERM "$dir/rabbitmq/rabbitmq.pid"
      _nb_db_signal TERM "$dir/rabbitmq/epmd.pid"
    fi
    sleep 0.1
  done
  local leftover
  mapfile -t leftover < <(_nb_db_processes "$dir")
  if (( ${#leftover[@]} > 0 )); then
    nb_warn "test databases did not stop within ${NB_DB_STOP_TIMEOUT}s; killing ${leftover[*]}"
    kill -KILL "${leftover[@]}" 2>/dev/null || true
    sleep 0.5
  fi
  rm -rf --one-file-system "$dir" || nb_warn "could not remove $dir"
}

# --- helpers ----------------------------------------------------------------------------

_nb_db_check_external() {
  local server name missing=()
  for server in PG MYSQL; do
    for name in HOST PORT USER PASSWORD DATABASE; do
      [[ -n "$(printenv "NEVERBLOCK_${server}_$name")" ]] || missing+=("NEVERBLOCK_${server}_$name")
    done
  done
  [[ -n "${NEVERBLOCK_REDIS_URL:-}" ]] || missing+=(NEVERBLOCK_REDIS_URL)
  (( ${#missing[@]} == 0 )) ||
    nb_die "NEVERBLOCK_DATABASES=external, but these are not exported: ${missing[*]}"
  nb_log "using external databases: PostgreSQL on $NEVERBLOCK_PG_HOST:$NEVERBLOCK_PG_PORT," \
         "MariaDB/MySQL on $NEVERBLOCK_MYSQL_HOST:$NEVERBLOCK_MYSQL_PORT, Redis at $NEVERBLOCK_REDIS_URL"
}

# _nb_db_free_ports COUNT: prints COUNT free TCP ports on 127.0.0.1, held open together so
# that they differ. (Perl, because Debian always has it; the kernel picks the ports.)
_nb_db_free_ports() {
  perl -MIO::Socket::INET -e '
    my @s = map { IO::Socket::INET->new(Listen => 1, LocalAddr => "127.0.0.1", LocalPort => 0)
                  or die "cannot bind 127.0.0.1: $!\n" } 1 .. $ARGV[0];
    print join(" ", map { $_->sockport } @s), "\n";' "$1"
}

# Pids of the processes running with their working directory in DIR: the supervisors
# (which cd there) and the servers (which cd to their data directories), including
# PostgreSQL backends, which leave the postmaster's session. Not this shell.
_nb_db_processes() {
  local link pid
  while read -r link; do
    pid="${link#/proc/}"; pid="${pid%/cwd}"
    [[ "$pid" == "$$" || "$pid" == "$BASHPID" ]] || echo "$pid"
  done < <(find /proc/[0-9]*/cwd -maxdepth 0 \( -lname "$1" -o -lname "$1/*" \) 2>/dev/null)
}

# _nb_db_signal SIGNAL PIDFILE: signal the server whose pid is the file's first line. A pid
# file left behind by a server that has exited (memcached's, written by its shell) is no error.
_nb_db_signal() {
  local pid=""
  [[ -r "$2" ]] && { read -r pid 2>/dev/null <"$2" || true; }   # RabbitMQ's has no final newline
  if [[ "$pid" =~ ^[0-9]+$ ]]; then kill "-$1" "$pid" 2>/dev/null || true; fi
  return 0
}

# _nb_db_supervise LOG CMD...: run CMD (a server that stays in the foreground) in a new
# session, with its output appended to LOG, and start it again whenever it exits until the
# stop file exists. (The pause keeps a server that cannot start from spinning; its log
# says why, and _nb_db_wait_ready gives up.)
_nb_db_supervise() {
  # shellcheck disable=SC2016  # expanded by the supervisor's bash
  setsid bash -c '
    cd "$1" || exit 1
    stop="$1/stop" log="$2"; shift 2
    until [[ -e "$stop" ]]; do
      "$@" >>"$log" 2>&1
      [[ -e "$stop" ]] || sleep 0.2
    done' nb-db-supervisor "$NB_DB_DIR" "$@" </dev/null >/dev/null 2>&1 &
}

# If the shell that started the servers disappears without stopping them (kill -9), stop
# them: a second bash in its own session polls for it each second, and ends when the stop
# file appears or the directory is gone (nb_databases_stop also ends it at once).
_nb_db_watchdog() {
  # shellcheck disable=SC2016
  setsid bash -c '
    source "$1/common.sh"; source "$1/databases.sh"
    owner="$2" dir="$3"
    cd /
    echo "$$" >"$dir/watchdog.pid"
    while kill -0 "$owner" 2>/dev/null && [[ -d "$dir" && ! -e "$dir/stop" ]]; do sleep 1; done
    if [[ -d "$dir" && ! -e "$dir/stop" ]]; then NB_DB_DIR="$dir" nb_databases_stop; fi
    ' nb-db-watchdog "$NB_REPO/bin/lib" "$$" "$NB_DB_DIR" </dev/null >/dev/null 2>&1 &
}

# _nb_db_wait_ready NAME LOG CMD...: retry CMD until it succeeds; after NB_DB_START_TIMEOUT
# seconds, show the end of LOG and fail.
_nb_db_wait_ready() {
  local name="$1" log="$2" deadline=$(( SECONDS + NB_DB_START_TIMEOUT ))
  shift 2
  until "$@" >/dev/null 2>&1; do
    if (( SECONDS >= deadline )); then
      tail -n 20 "$log" >&2 || true
      nb_die "$name did not accept connections within ${NB_DB_START_TIMEOUT}s (end of $log above)"
    fi
    sleep 0.1
  done
}

# _nb_db_run_logged NAME LOG CMD...: run a setup command with its output in LOG; on
# failure show the end of LOG and fail.
_nb_db_run_logged() {
  local name="$1" log="$2"
  shift 2
  if ! "$@" >"$log" 2>&1; then
    tail -n 20 "$log" >&2 || true
    nb_die "$name failed (end of $log above)"
  fi
}

# Run a PostgreSQL program as the postgres user (the server refuses root), from a directory
# that user may read.
_nb_as_postgres() (
  cd /
  exec setpriv --reuid=postgres --regid=postgres --init-groups -- "$@"
)

_nb_pg_start() {
  local port="$1" dir="$NB_DB_DIR/pg"
  local data="$dir/data" log="$dir/postgres.log"
  _nb_db_run_logged initdb "$dir/initdb.log" \
    _nb_as_postgres "$NB_PG_BIN/initdb" -D "$data" -U postgres --auth=trust --no-sync \
                    --encoding=UTF8 --locale=C.UTF-8
  cat >>"$data/postgresql.conf" <<EOF

# bin/lib/databases.sh: a throwaway server for tests and benchmarks.
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$dir'
max_connections = 300
shared_buffers = 128MB
fsync = off
synchronous_commit = off
full_page_writes = off
EOF
  cat >"$data/pg_hba.conf" <<EOF
# TYPE  DATABASE  USER  ADDRESS       METHOD
local   all       all                 trust
host    all       all   127.0.0.1/32  scram-sha-256
host    all       all   ::1/128       scram-sha-256
EOF
  _nb_db_supervise "$log" setpriv --reuid=postgres --regid=postgres --init-groups -- \
    "$NB_PG_BIN/postgres" -D "$data"
  _nb_db_wait_ready PostgreSQL "$log" "$NB_PG_BIN/pg_isready" -q -h "$dir" -p "$port"

  # psql quotes :'password' as a literal.
  _nb_db_run_logged "creating the PostgreSQL role" "$dir/setup.log" \
    "$NB_PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -v password="$NB_DB_PASSWORD" \
      -h "$dir" -p "$port" -U postgres -d postgres <<'SQL'
CREATE ROLE neverblock LOGIN SUPERUSER PASSWORD :'password';
CREATE DATABASE neverblock_test OWNER neverblock;
SQL

  export NEVERBLOCK_PG_HOST=127.0.0.1 NEVERBLOCK_PG_PORT="$port" NEVERBLOCK_PG_USER=neverblock
  export NEVERBLOCK_PG_PASSWORD="$NB_DB_PASSWORD" NEVERBLOCK_PG_DATABASE=neverblock_test
  export NEVERBLOCK_PG_BIN="$NB_PG_BIN"
  # Over TCP with the password, as the tests connect; and the port is this server's, not
  # another that took it first.
  local version datadir
  IFS='|' read -r version datadir < <(
    PGPASSWORD="$NB_DB_PASSWORD" "$NB_PG_BIN/psql" -X -At -h 127.0.0.1 -p "$port" -U neverblock \
      -d neverblock_test -c "SELECT current_setting('server_version'), current_setting('data_directory')"
  ) || true
  [[ "$datadir" == "$data" ]] ||
    nb_die "PostgreSQL: neverblock@127.0.0.1:$port does not reach the server just started (log: $log)"
  nb_log "PostgreSQL $version on 127.0.0.1:$port"
}

_nb_mysql_start() {
  local port="$1" dir="$NB_DB_DIR/mysql"
  local log="$dir/mysqld.log" socket="$dir/mysqld.sock"
  # root logs in through the socket only, as the OS user root (unix_socket).
  # A tmpdir of its own: at start-up mariadbd (and mariadb-install-db's bootstrap) deletes
  # every #sql temporary table it finds in its tmpdir, so servers sharing /tmp (bin/test
  # --jobs) deleted each other's ("Unknown table 'mysql.tmp_user_sys'": 2 in 15 installs
  # failed five at a time; none in 20 with their own tmpdir).
  install -d -o mysql -g mysql "$dir/tmp"
  _nb_db_run_logged mariadb-install-db "$dir/install.log" \
    mariadb-install-db --no-defaults --user=mysql --datadir="$dir/data" --tmpdir="$dir/tmp" \
      --auth-root-authentication-method=socket --skip-test-db --skip-name-resolve
  # --user=mysql: mariadbd starts as root and drops to mysql.
  _nb_db_supervise "$dir/mysqld.out" \
    mariadbd --no-defaults --user=mysql --datadir="$dir/data" --tmpdir="$dir/tmp" --socket="$socket" \
      --port="$port" --bind-address=127.0.0.1 --skip-name-resolve \
      --pid-file="$dir/mysqld.pid" --log-error="$log" \
      --innodb-flush-log-at-trx-commit=0 --max-connections=300
  _nb_db_wait_ready MariaDB "$log" mariadb-admin --no-defaults --socket="$socket" -uroot ping

  local password="${NB_DB_PASSWORD//\\/\\\\}"
  password="${password//\'/\'\'}"
  _nb_db_run_logged "creating the MariaDB user" "$dir/setup.log" \
    mariadb --no-defaults --socket="$socket" -uroot -e "
      CREATE DATABASE neverblock_test;
      CREATE USER 'neverblock'@'%' IDENTIFIED BY '$password';
      CREATE USER 'neverblock'@'localhost' IDENTIFIED BY '$password';
      GRANT ALL PRIVILEGES ON *.* TO 'neverblock'@'%';
      GRANT ALL PRIVILEGES ON *.* TO 'neverblock'@'localhost';"

  export NEVERBLOCK_MYSQL_HOST=127.0.0.1 NEVERBLOCK_MYSQL_PORT="$port" NEVERBLOCK_MYSQL_USER=neverblock
  export NEVERBLOCK_MYSQL_PASSWORD="$NB_DB_PASSWORD" NEVERBLOCK_MYSQL_DATABASE=neverblock_test
  local version datadir
  IFS=$'\t' read -r version datadir < <(
    MYSQL_PWD="$NB_DB_PASSWORD" mariadb --no-defaults -N -h 127.0.0.1 -P "$port" -u neverblock \
      neverblock_test -e 'SELECT VERSION(), @@datadir'
  ) || true
  [[ "${datadir%/}" == "$dir/data" ]] ||
    nb_die "MariaDB: neverblock@127.0.0.1:$port does not reach the server just started (log: $log)"
  nb_log "MariaDB $version on 127.0.0.1:$port"
}

_nb_redis_start() {
  local port="$1" dir="$NB_DB_DIR/redis"
  local log="$dir/redis.log"
  # Debian's redis-server, as the redis user, in the foreground under the supervisor; no
  # persistence (nothing to save between test runs).
  _nb_db_supervise "$dir/redis.out" \
    setpriv --reuid=redis --regid=redis --init-groups -- \
    redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --pidfile "$dir/redis.pid" \
      --logfile "$log" --save "" --appendonly no --daemonize no --maxclients 1000
  _nb_db_wait_ready Redis "$log" redis-cli -h 127.0.0.1 -p "$port" ping

  export NEVERBLOCK_REDIS_URL="redis://127.0.0.1:$port/0"
  local version
  version="$(redis-cli -h 127.0.0.1 -p "$port" info server | sed -n 's/^redis_version:\([^[:space:]]*\).*/\1/p')"
  nb_log "Redis $version on 127.0.0.1:$port"
}

_nb_memcached_start() {
  local port="$1" dir="$NB_DB_DIR/memcached"
  # memcached writes a pid file only when it daemonizes; the shell writes it, then becomes it.
  # shellcheck disable=SC2016
  _nb_db_supervise "$dir/memcached.out" \
    setpriv --reuid=memcache --regid=memcache --init-groups -- \
    sh -c 'echo $$ >"$1"; shift; exec "$@"' memcached "$dir/memcached.pid" \
      memcached -l 127.0.0.1 -p "$port" -U 0 -m 64 -c 1024
  _nb_db_wait_ready memcached "$dir/memcached.out" _nb_memcached_ping "$port"

  export NEVERBLOCK_MEMCACHED_SERVER="127.0.0.1:$port"
  nb_log "memcached $(_nb_memcached_ping "$port") on 127.0.0.1:$port"
}

# Prints the version memcached at 127.0.0.1:PORT answers with (fails when none answers).
_nb_memcached_ping() {
  perl -MIO::Socket::INET -e '
    my $s = IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $ARGV[0], Timeout => 1) or exit 1;
    print $s "version\r\n"; my $line = <$s>; $line =~ /^VERSION (\S+)/ or exit 1; print "$1\n";' "$1"
}

# RabbitMQ with an epmd (Erlang's port mapper) of its own on a free port, so that runs in
# parallel never share one, and no plugins. Both run as the rabbitmq user under supervisors,
# with HOME (the Erlang cookie) in the directory. _nb_rabbitmq_wait waits for the AMQP port.
_nb_rabbitmq_launch() {
  local amqp_port="$1" dist_port="$2" epmd_port="$3" dir="$NB_DB_DIR/rabbitmq"
  echo '[].' >"$dir/enabled_plugins"
  chown rabbitmq:rabbitmq "$dir/enabled_plugins"
  # shellcheck disable=SC2016
  _nb_db_supervise "$dir/epmd.out" \
    setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups -- \
    sh -c 'echo $$ >"$1"; shift; exec "$@"' epmd "$dir/epmd.pid" \
      epmd -port "$epmd_port" -address 127.0.0.1
  _nb_db_wait_ready epmd "$dir/epmd.out" env ERL_EPMD_PORT="$epmd_port" epmd -names
  _nb_db_supervise "$dir/rabbitmq.out" \
    setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups -- \
    env HOME="$dir" ERL_EPMD_PORT="$epmd_port" RABBITMQ_NODENAME="neverblock-$epmd_port@localhost" \
        RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT="$amqp_port" \
        RABBITMQ_DIST_PORT="$dist_port" RABBITMQ_MNESIA_BASE="$dir/mnesia" \
        RABBITMQ_LOG_BASE="$dir/log" RABBITMQ_CONFIG_FILE="$dir/rabbitmq" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" RABBITMQ_PID_FILE="$dir/rabbitmq.pid" \
      /usr/lib/rabbitmq/bin/rabbitmq-server
}

_nb_rabbitmq_wait() {
  local port="$1" dir="$NB_DB_DIR/rabbitmq"
  # The AMQP listener opens once the broker has booted.
  _nb_db_wait_ready RabbitMQ "$dir/rabbitmq.out" \
    perl -MIO::Socket::INET -e 'IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $ARGV[0]) or exit 1' "$port"
  export NEVERBLOCK_AMQP_URL="amqp://guest:guest@127.0.0.1:$port"
  local version
  version="$(sed -n 's/.*RabbitMQ \([0-9][0-9.]*\).*/\1/p' "$dir/rabbitmq.out" | head -n 1)"
  nb_log "RabbitMQ ${version:-?} on 127.0.0.1:$port"
}
