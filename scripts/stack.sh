#!/usr/bin/env bash
# The embedded local stack: a Kafka-protocol broker (tansu, sqlite storage) and an S3 server
# (s3s-fs), both on 127.0.0.1, plus the runtime assets (ONNX Runtime, the terrain model).
#
#   scripts/stack.sh up [DIR]             start (idempotent); writes DIR/env with `export` lines
#   scripts/stack.sh down [DIR]           stop and keep the data
#   scripts/stack.sh status [DIR]
#   scripts/stack.sh stop-s3|start-s3 [DIR]              fault injection for the chaos tests
#   scripts/stack.sh pause-s3|resume-s3 [DIR]            (pause: SIGSTOP, a server that hangs)
#   scripts/stack.sh stop-broker|start-broker|restart-broker [DIR]
#
# DIR defaults to .stack. With SLUICE_STACK_OWNER_PID set, `up` also starts a watchdog that
# takes the stack down when that process exits (tests use it, so a crashed test run never
# leaves servers behind).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
cmd="${1:-up}"
dir="${2:-${SLUICE_STACK_DIR:-.stack}}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
TANSU="$CACHE/tools/tansu-0.6.0/bin/tansu"
S3S="$CACHE/tools/s3s-fs-0.14.1/bin/s3s-fs"
BUCKET=sluice
ACCESS_KEY=sluice
SECRET_KEY=sluice-secret-key
TASK_PARTITIONS="${SLUICE_TASK_PARTITIONS:-8}"
# sqlite keeps data across broker restarts and reports correct watermarks; memory is faster but
# loses everything on restart and miscounts high watermarks (see shared notes).
BROKER_STORAGE="${SLUICE_BROKER_STORAGE:-sqlite}"

log() { echo "==> $*" >&2; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

alive() { [ -f "$dir/$1.pid" ] && kill -0 "$(cat "$dir/$1.pid")" 2>/dev/null; }

wait_port() { # port seconds pidname
  local port=$1 deadline=$((SECONDS + $2))
  while [ $SECONDS -lt $deadline ]; do
    alive "$3" || return 1
    if python3 -c "import socket,sys; s=socket.socket(); s.settimeout(0.2); sys.exit(s.connect_ex(('127.0.0.1', $port)))" 2>/dev/null; then
      return 0
    fi
    sleep 0.05
  done
  return 1
}

port_of() { cat "$dir/$1.port" 2>/dev/null || true; }

storage_url() {
  local engine; engine="$(cat "$dir/broker.storage" 2>/dev/null || echo "$BROKER_STORAGE")"
  echo "$engine" >"$dir/broker.storage"
  case "$engine" in
    sqlite) echo "sqlite://tansu.db" ;;
    memory) echo "memory://tansu/" ;;
    *) echo "unknown SLUICE_BROKER_STORAGE $engine (sqlite or memory)" >&2; exit 2 ;;
  esac
}

# tansu 0.6's sqlite schema has no index on record headers: every fetch looks up each record's
# headers by scanning the whole header table, so fetches get slower with every record ever
# written (perf: most broker CPU in sqlite row scans). An index makes the lookup direct; it
# changes nothing else. Idempotent; python3's sqlite3 module, no sqlite3 binary needed.
index_broker_db() {
  [ "$(cat "$dir/broker.storage" 2>/dev/null || echo sqlite)" = sqlite ] || return 0
  local db="$dir/broker/tansu.db"
  for _ in $(seq 1 50); do [ -s "$db" ] && break; sleep 0.1; done
  python3 - "$db" <<'PY' || log "could not index the broker's header table (slower fetches only)"
import sqlite3, sys, time
for attempt in range(50):
    try:
        c = sqlite3.connect(sys.argv[1], timeout=10)
        if c.execute("select 1 from sqlite_master where type='table' and name='header'").fetchone():
            c.execute("create index if not exists sluice_header_record on header (topition, offset_id)")
            c.commit()
            break
        c.close()
    except sqlite3.OperationalError:
        pass
    time.sleep(0.1)
PY
}

start_broker() {
  alive broker && return 0
  local port; port="$(port_of broker)"
  for attempt in 1 2 3; do
    [ -n "$port" ] || port="$(free_port)"
    mkdir -p "$dir/broker" "$dir/logs"
    # tansu reads its settings from the environment too; name every one of them explicitly.
    (cd "$dir/broker" && exec env -u CLUSTER_ID -u LISTENER_URL -u ADVERTISED_LISTENER_URL -u STORAGE_ENGINE \
      setsid "$TANSU" broker \
        --listener-url "tcp://127.0.0.1:$port" \
        --advertised-listener-url "tcp://127.0.0.1:$port" \
        --storage-engine "$(storage_url)" \
        >>"$dir/logs/broker.log" 2>&1 </dev/null) &
    echo $! >"$dir/broker.pid"
    echo "$port" >"$dir/broker.port"
    # A taken port makes tansu panic and exit 0: check it is alive, not its exit status.
    if wait_port "$port" 15 broker; then
      index_broker_db
      return 0
    fi
    log "broker did not start on port $port (see $dir/logs/broker.log); trying another port"
    kill "$(cat "$dir/broker.pid")" 2>/dev/null || true
    rm -f "$dir/broker.port"
    port=""
  done
  echo "the broker failed to start; see $dir/logs/broker.log" >&2
  exit 1
}

start_s3() {
  alive s3 && return 0
  local port; port="$(port_of s3)"
  for attempt in 1 2 3; do
    [ -n "$port" ] || port="$(free_port)"
    mkdir -p "$dir/s3/$BUCKET" "$dir/logs"
    setsid "$S3S" --host 127.0.0.1 --port "$port" --access-key "$ACCESS_KEY" --secret-key "$SECRET_KEY" "$dir/s3" \
      >>"$dir/logs/s3.log" 2>&1 </dev/null &
    echo $! >"$dir/s3.pid"
    echo "$port" >"$dir/s3.port"
    if wait_port "$port" 10 s3; then
      return 0
    fi
    log "S3 server did not start on port $port (see $dir/logs/s3.log); trying another port"
    kill "$(cat "$dir/s3.pid")" 2>/dev/null || true
    rm -f "$dir/s3.port"
    port=""
  done
  echo "the S3 server failed to start; see $dir/logs/s3.log" >&2
  exit 1
}

stop() { # name
  if alive "$1"; then
    local pid; pid="$(cat "$dir/$1.pid")"
    kill -TERM "$pid" 2>/dev/null || true
    kill -CONT "$pid" 2>/dev/null || true # a paused server handles TERM once it runs again
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$dir/$1.pid"
}

create_topics() {
  local broker="tcp://127.0.0.1:$(port_of broker)"
  local existing; existing="$("$TANSU" topic list --broker "$broker" 2>/dev/null || true)"
  for spec in "sluice.tasks.v1:$TASK_PARTITIONS" "sluice.completions.v1:4" "sluice.dlq.v1:2" "sluice.progress.v1:4" "sluice.control.v1:2" "sluice.webhooks.retry.v1:8" "sluice.webhooks.dlq.v1:2"; do
    local name="${spec%%:*}" partitions="${spec##*:}"
    if ! grep -qw "$name" <<<"$existing"; then
      "$TANSU" topic create --broker "$broker" --partitions "$partitions" "$name" >/dev/null 2>>"$dir/logs/topics.log" \
        || grep -qw "$name" <<<"$("$TANSU" topic list --broker "$broker" 2>/dev/null)" \
        || { echo "creating topic $name failed; see $dir/logs/topics.log" >&2; exit 1; }
    fi
  done
}

write_env() {
  local assets; assets="$("$here/fetch-assets.sh")"
  local model; model="$(sed -n 's/^export SLUICE_TERRAIN_MODEL=//p' <<<"$assets")"
  mkdir -p "$dir/models/terrain"
  ln -sfn "$model" "$dir/models/terrain/model.onnx"
  local sd; sd="$(sed -n 's/^export SLUICE_SD_TINY=//p' <<<"$assets")"
  ln -sfn "$sd/sd-tiny" "$dir/models/sd-tiny"
  cat >"$dir/env.tmp" <<ENV
# Written by scripts/stack.sh; source it: . $dir/env
export SLUICE_STACK_DIR=$dir
export SLUICE_KAFKA_BROKERS=127.0.0.1:$(port_of broker)
export AWS_ENDPOINT_URL=http://127.0.0.1:$(port_of s3)
export AWS_ACCESS_KEY_ID=$ACCESS_KEY
export AWS_SECRET_ACCESS_KEY=$SECRET_KEY
export AWS_REGION=us-east-1
export AWS_ALLOW_HTTP=true
export SLUICE_OUTPUT_URL=s3://$BUCKET/outputs
export SLUICE_MODEL_DIR=$dir/models
$(grep -E '^export (ORT_DYLIB_PATH|SLUICE_ONNX_PYTHON|SLUICE_SD_TINY)=' <<<"$assets")
ENV
  mv "$dir/env.tmp" "$dir/env"
}

watchdog() {
  local owner="${SLUICE_STACK_OWNER_PID:-}"
  [ -n "$owner" ] || return 0
  (setsid bash -c "while kill -0 $owner 2>/dev/null; do sleep 1; done; '$here/stack.sh' down '$dir' >/dev/null 2>&1" </dev/null >/dev/null 2>&1 &)
}

case "$cmd" in
  up)
    "$here/install-tools.sh" all
    start_broker
    start_s3
    create_topics
    write_env
    watchdog
    log "stack up: broker 127.0.0.1:$(port_of broker), S3 http://127.0.0.1:$(port_of s3); settings in $dir/env"
    ;;
  down)
    stop broker
    stop s3
    ;;
  status)
    for n in broker s3; do
      if alive $n; then echo "$n: running (pid $(cat "$dir/$n.pid"), port $(port_of $n))"; else echo "$n: stopped"; fi
    done
    ;;
  stop-s3) stop s3 ;;
  start-s3) start_s3 ;;
  pause-s3) alive s3 && kill -STOP "$(cat "$dir/s3.pid")" ;;
  resume-s3) alive s3 && kill -CONT "$(cat "$dir/s3.pid")" ;;
  stop-broker) stop broker ;;
  start-broker) start_broker ;;
  restart-broker) stop broker; start_broker ;;
  topic)
    # topic DIR NAME PARTITIONS: one more topic (tests give each scenario its own).
    "$TANSU" topic create --broker "tcp://127.0.0.1:$(port_of broker)" --partitions "${4:?partitions}" "${3:?name}" >/dev/null 2>>"$dir/logs/topics.log" \
      || grep -qw "$3" <<<"$("$TANSU" topic list --broker "tcp://127.0.0.1:$(port_of broker)" 2>/dev/null)" \
      || { echo "creating topic $3 failed; see $dir/logs/topics.log" >&2; exit 1; }
    ;;
  *) echo "usage: $0 up|down|status|stop-s3|start-s3|pause-s3|resume-s3|stop-broker|start-broker|restart-broker [DIR] | topic DIR NAME PARTITIONS" >&2; exit 2 ;;
esac
