#!/usr/bin/env bash
# The embedded local stack: Apache Kafka (one KRaft controller and one broker, jars from Maven Central) and
# an S3 server (s3s-fs), both on 127.0.0.1, plus the runtime assets (ONNX Runtime, the terrain model).
#
#   scripts/stack.sh up [DIR]             start (idempotent); writes DIR/env with `export` lines
#   scripts/stack.sh down [DIR]           stop and keep the data
#   scripts/stack.sh status [DIR]
#   scripts/stack.sh stop-s3|start-s3 [DIR]              fault injection for the chaos tests
#   scripts/stack.sh pause-s3|resume-s3 [DIR]            (pause: SIGSTOP, a server that hangs)
#   scripts/stack.sh stop-broker|start-broker|restart-broker [DIR]
#   scripts/stack.sh kill-broker [DIR]                   SIGKILL, no controlled shutdown (kill -9);
#                                                        the controller stays up
#   scripts/stack.sh topic DIR NAME PARTITIONS           one more topic (exists already: fine)
#
# DIR defaults to .stack. With SLUICE_STACK_OWNER_PID set, `up` also starts a watchdog that
# takes the stack down when that process exits (tests use it, so a crashed test run never
# leaves servers behind). SLUICE_KAFKA_HEAP sets the broker's maximum heap (default 768m).
# Logs: DIR/logs/broker.log, controller.log, admin.log (scripts/kafka/StackAdmin.java), s3.log.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
cmd="${1:-up}"
dir="${2:-${SLUICE_STACK_DIR:-.stack}}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
S3S="$CACHE/tools/s3s-fs-0.14.1/bin/s3s-fs"
BUCKET=sluice
ACCESS_KEY=sluice
SECRET_KEY=sluice-secret-key
TASK_PARTITIONS="${SLUICE_TASK_PARTITIONS:-8}"
KAFKA_LIB="" # the broker's classpath directory; set by need_kafka

log() { echo "==> $*" >&2; }

free_ports() { # count: distinct free ports (all bound at once, so never the same one twice)
  python3 -c 'import socket,sys
ss=[socket.socket() for _ in range(int(sys.argv[1]))]
for s in ss: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in ss))' "${1:-1}"
}

# A process that exists and is not a zombie (this machine's init can take a second to reap one).
running() { kill -0 "$1" 2>/dev/null && ! grep -qs ') Z ' "/proc/$1/stat"; }

alive() { [ -f "$dir/$1.pid" ] && running "$(cat "$dir/$1.pid")"; }

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

# The Kafka jars (fetched by install-tools.sh the first time; a no-op after that).
need_kafka() { [ -n "$KAFKA_LIB" ] || KAFKA_LIB="$("$here/install-tools.sh" kafka-lib)"; }

# Log4j settings for a Kafka JVM, into LOG4J: one config file, logs under DIR/logs.
log4j() { # file level
  LOG4J=("-Dlog4j2.configurationFile=$here/kafka/log4j2.properties" "-Dsluice.log.dir=$dir/logs"
    "-Dsluice.log.file=$1" "-Dsluice.log.level=$2")
}

# Kafka's own client for the readiness check and topic creation (scripts/kafka/StackAdmin.java).
# Short-lived: C1 only and a small serial-GC heap start it faster than the server defaults.
admin() {
  need_kafka
  mkdir -p "$dir/logs"
  log4j admin.log WARN
  java -Xshare:auto -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xmx128m "${LOG4J[@]}" \
    -cp "$KAFKA_LIB/*" "$here/kafka/StackAdmin.java" "$@"
}

# A KRaft cluster of two processes, as production runs them: a controller and one broker. Not one
# process with both roles: such a node, killed with -9 and restarted, acts on its stale metadata
# (in which it still leads every partition) for the seconds until its restarted controller fences
# its previous registration. Transaction markers it sends in that window then find no leader, and
# Kafka drops them as if the partitions had been deleted, which leaves a committed transaction open
# on them for good: read_committed readers and a group's stable offset reads wait forever (seen in
# the chaos suite's all-faults run on Kafka 4.3.1: the broker log says "Couldn't find leader
# endpoint ... likely deleted already and hence can be skipped"). With the controller apart, a
# killed broker is fenced while it is down (see kill_broker), and a restarted one leads nothing
# until it has registered again.
#
# Both configs are rewritten at each start (the ports are the stored ones), so an existing stack
# picks up changes made here.
CONTROLLER_ID=1000
BROKER_SESSION_MS=3000

write_controller_config() { # controller-port
  mkdir -p "$dir/controller"
  cat >"$dir/controller/server.properties" <<PROPS
# Written by scripts/stack.sh at each controller start; edit the script, not this file.
process.roles=controller
node.id=$CONTROLLER_ID
controller.quorum.voters=$CONTROLLER_ID@127.0.0.1:$1
listeners=CONTROLLER://127.0.0.1:$1
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT
log.dirs=$dir/controller/data
# A broker that stops heartbeating is fenced after 3 s, not the default 9 s: a killed broker's
# partitions lose their leader sooner, and its restart can register sooner.
broker.session.timeout.ms=$BROKER_SESSION_MS
PROPS
}

write_broker_config() { # broker-port controller-port
  cat >"$dir/broker/server.properties" <<PROPS
# Written by scripts/stack.sh at each broker start; edit the script, not this file.
process.roles=broker
node.id=1
controller.quorum.voters=$CONTROLLER_ID@127.0.0.1:$2
listeners=PLAINTEXT://127.0.0.1:$1
advertised.listeners=PLAINTEXT://127.0.0.1:$1
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$dir/broker/data
# One broker: the internal topics can only have one replica.
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
# Topics exist because stack.sh or a test created them: a misspelt name fails instead of creating one.
auto.create.topics.enable=false
num.partitions=1
# A group's first member starts at once, not after 3 s of waiting for others.
group.initial.rebalance.delay.ms=0
# Records up to 32 MiB, as Sluice's clients are configured (service/src/kafka.rs MAX_MESSAGE_BYTES),
# not Kafka's 1 MB default: a DLQ record carries its original record base64-encoded, so a task
# near SLUICE_MAX_TASK_BYTES (1 MiB) needs ~1.4 MB on sluice.dlq.v1. A deployment sets the same
# on the DLQ topic (max.message.bytes); see docs/local-stack.md.
message.max.bytes=33554432
replica.fetch.max.bytes=33554432
# 8 partitions, not 50, for the offsets, transaction and share-state topics: each partition is a
# log with files, index maps and a coordinator to load, for a handful of groups and producers.
offsets.topic.num.partitions=8
transaction.state.log.num.partitions=8
share.coordinator.state.topic.num.partitions=8
# 16 MiB segments with 1 MiB indexes (defaults 1 GiB and 10 MiB, the index mapped per partition):
# test data is small, and the tests create many partitions.
log.segment.bytes=16777216
log.index.size.max.bytes=1048576
# The log cleaner (compacts __consumer_offsets) holds this buffer on the heap: 16 MiB, not 128.
log.cleaner.dedupe.buffer.size=16777216
# Heartbeats to the controller at a quarter of its 3 s session timeout (default 2 s of 9 s).
broker.heartbeat.interval.ms=750
# KIP-848 consumer groups: the broker sets the timeouts (45 s session, 5 s heartbeat by default).
# Use the ones the worker and producer ask of classic groups (session 10 s, heartbeat 1 s), so a
# killed member's partitions move on as soon whichever protocol a client picks.
group.consumer.min.session.timeout.ms=6000
group.consumer.session.timeout.ms=10000
group.consumer.min.heartbeat.interval.ms=1000
group.consumer.heartbeat.interval.ms=1000
PROPS
}

# Formats a node's storage once (meta.properties, and the metadata log), with Kafka's own tool in a
# JVM of its own: it calls System.exit. Both nodes get the stack's one cluster id.
format_node() { # name (controller|broker)
  [ -f "$dir/$1/data/meta.properties" ] && return 0
  if [ ! -f "$dir/cluster.id" ]; then
    # A random cluster id: 16 bytes, URL-safe base64 without padding, as Kafka's Uuid.
    python3 -c 'import base64,uuid
while True:
    s = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    if not s.startswith("-"): break  # would read as an option (Kafka avoids these ids too)
print(s)' >"$dir/cluster.id"
  fi
  log4j "$1.log" INFO
  java -Xshare:auto -XX:TieredStopAtLevel=1 -XX:+UseSerialGC "${LOG4J[@]}" -cp "$KAFKA_LIB/*" \
    kafka.tools.StorageTool format -t "$(cat "$dir/cluster.id")" -c "$dir/$1/server.properties" >>"$dir/logs/$1.log" 2>&1 \
    || { echo "formatting the $1's storage failed; see $dir/logs/$1.log" >&2; exit 1; }
}

# A stack made before the controller had its own process keeps its metadata in the broker's data,
# as a node with both roles: unusable by a broker alone. It is local test data; start afresh.
forget_combined_node() {
  if [ -f "$dir/broker/data/meta.properties" ] && [ ! -f "$dir/controller/data/meta.properties" ]; then
    log "the stack's Kafka data in $dir/broker is from a single-process node; starting it afresh"
    rm -rf "$dir/broker/data" "$dir/cluster.id"
  fi
}

# Starts a formatted node's JVM in the background, in a session of its own (setsid),
# with its pid in DIR/NAME.pid and its log in DIR/logs/NAME.log.
launch_node() { # name (controller|broker) min-heap max-heap
  log4j "$1.log" INFO
  (cd "$dir/$1" && exec setsid java -Xms"$2" -Xmx"$3" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -XX:+ExitOnOutOfMemoryError -Xshare:auto -Djava.awt.headless=true "${LOG4J[@]}" \
    -cp "$KAFKA_LIB/*" kafka.Kafka "$dir/$1/server.properties" >>"$dir/logs/$1.log" 2>&1 </dev/null) &
  echo $! >"$dir/$1.pid"
}

start_controller() { # controller-port
  alive controller && return 0
  write_controller_config "$1"
  format_node controller
  launch_node controller 64m 256m
}

# A broker killed with -9 is restarted only once the controller has fenced it (its session timed
# out, a heartbeat interval after): before that the controller refuses the new registration, and
# the restarted broker would wait for it anyway.
wait_fenced() {
  [ -f "$dir/broker.killed" ] || return 0
  python3 -c 'import sys,time
left = float(sys.argv[1]) + float(sys.argv[2]) / 1000 + 1.0 - time.time()
time.sleep(max(0.0, left))' "$(cat "$dir/broker.killed")" "$BROKER_SESSION_MS"
  rm -f "$dir/broker.killed"
}

start_broker() {
  alive broker && return 0
  need_kafka
  mkdir -p "$dir/broker/data" "$dir/controller/data" "$dir/logs"
  forget_combined_node
  wait_fenced
  # The ports are picked once and kept, so clients reconnect to the same address after a restart.
  local bport cport fresh=""
  bport="$(port_of broker)" cport="$(port_of controller)"
  if [ -z "$bport" ] || [ -z "$cport" ]; then fresh=1; fi
  # The heap is bounded; -Xms follows a SLUICE_KAFKA_HEAP override (the JVM refuses -Xms > -Xmx).
  local xmx="${SLUICE_KAFKA_HEAP:-768m}" xms="${SLUICE_KAFKA_HEAP:-256m}"
  for _ in 1 2 3; do
    if [ -n "$fresh" ]; then read -r bport cport <<<"$(free_ports 2)"; fi
    echo "$bport" >"$dir/broker.port"
    echo "$cport" >"$dir/controller.port"
    start_controller "$cport"
    write_broker_config "$bport" "$cport"
    format_node broker
    launch_node broker "$xms" "$xmx"
    # Ready means a real request answered (metadata, then an acks=all produce), not a TCP accept.
    # StackAdmin gives up early when the broker process exits (a taken port, a bad config).
    if admin ready "127.0.0.1:$bport" "${SLUICE_KAFKA_START_TIMEOUT:-60}" "$(cat "$dir/broker.pid")"; then
      return 0
    fi
    if alive broker || [ -z "$fresh" ]; then
      break # hung, or it died on the ports that clients already know: new ports would not help
    fi
    log "broker did not start on ports $bport/$cport (see $dir/logs/broker.log, controller.log); trying others"
    stop controller 5
    rm -f "$dir/broker.port" "$dir/controller.port"
  done
  stop broker 0
  stop controller 0
  echo "the broker failed to start; see $dir/logs/broker.log and controller.log" >&2
  exit 1
}

# SIGKILL, no controlled shutdown; the controller stays up and fences it.
kill_broker() {
  alive broker || return 0
  stop broker 0
  date +%s.%N >"$dir/broker.killed"
}

start_s3() {
  alive s3 && return 0
  local port; port="$(port_of s3)"
  for _ in 1 2 3; do
    [ -n "$port" ] || port="$(free_ports 1)"
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

stop() { # name [seconds before SIGKILL; default 5]
  if alive "$1"; then
    local pid; pid="$(cat "$dir/$1.pid")"
    if [ "${2:-5}" -gt 0 ]; then
      kill -TERM "$pid" 2>/dev/null || true
      kill -CONT "$pid" 2>/dev/null || true # a paused server handles TERM once it runs again
      for _ in $(seq 1 $((${2:-5} * 20))); do running "$pid" || break; sleep 0.05; done
    fi
    kill -KILL "$pid" 2>/dev/null || true
    # Gone before returning: a start right after must not find it alive, nor its ports taken.
    for _ in $(seq 1 100); do running "$pid" || break; sleep 0.05; done
  fi
  rm -f "$dir/$1.pid"
}

# A Kafka broker's controlled shutdown (leadership handed over, logs flushed and closed) takes a
# few seconds: allow 10 before SIGKILL. (A SIGKILLed broker recovers its logs at the next start.)
stop_broker() { stop broker 10; }

# The whole cluster: the broker first, whose controlled shutdown needs its controller.
stop_kafka() { stop_broker; stop controller 5; }

topics() { # NAME:PARTITIONS[:compact]...  (compact: cleanup.policy=compact)
  admin topics "127.0.0.1:$(port_of broker)" "$@" \
    || { echo "creating topics failed (see $dir/logs/admin.log): $*" >&2; exit 1; }
}

create_topics() {
  topics "sluice.tasks.v1:$TASK_PARTITIONS" "sluice.tasks.interactive.v1:$TASK_PARTITIONS" \
    "sluice.tasks.batch.v1:$TASK_PARTITIONS" sluice.completions.v1:4 sluice.dlq.v1:2 sluice.progress.v1:4 \
    sluice.control.v1:2 sluice.webhooks.retry.v1:8 sluice.webhooks.dlq.v1:2 sluice.ceilings.v1:1:compact
}

write_env() {
  local assets; assets="$("$here/fetch-assets.sh")"
  local model; model="$(sed -n 's/^export SLUICE_TERRAIN_MODEL=//p' <<<"$assets")"
  mkdir -p "$dir/models"
  if [ -n "$model" ]; then # absent with SLUICE_ASSETS=no-terrain (a GPU node without network)
    mkdir -p "$dir/models/terrain"
    ln -sfn "$model" "$dir/models/terrain/model.onnx"
  fi
  local sd; sd="$(sed -n 's/^export SLUICE_SD_TINY=//p' <<<"$assets")"
  ln -sfn "$sd/sd-tiny" "$dir/models/sd-tiny"
  ln -sfn "$sd/sdxl-tiny" "$dir/models/sdxl-tiny"
  ln -sfn "$sd/sd-tiny-inpaint" "$dir/models/sd-tiny-inpaint"
  ln -sfn "$sd/flux-schnell-tiny" "$dir/models/flux-schnell-tiny"
  ln -sfn "$sd/flux-dev-tiny" "$dir/models/flux-dev-tiny"
  ln -sfn "$sd/sd3-tiny" "$dir/models/sd3-tiny"
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
export SLUICE_INPUT_URL=s3://$BUCKET/inputs
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
    "$here/install-tools.sh" stack
    start_broker
    start_s3
    create_topics
    write_env
    watchdog
    log "stack up: broker 127.0.0.1:$(port_of broker), S3 http://127.0.0.1:$(port_of s3); settings in $dir/env"
    ;;
  down)
    stop_kafka
    stop s3
    ;;
  status)
    for n in controller broker s3; do
      if alive $n; then echo "$n: running (pid $(cat "$dir/$n.pid"), port $(port_of $n))"; else echo "$n: stopped"; fi
    done
    ;;
  stop-s3) stop s3 ;;
  start-s3) start_s3 ;;
  pause-s3) alive s3 && kill -STOP "$(cat "$dir/s3.pid")" ;;
  resume-s3) alive s3 && kill -CONT "$(cat "$dir/s3.pid")" ;;
  stop-broker) stop_broker ;;
  kill-broker) kill_broker ;;
  start-broker) start_broker ;;
  restart-broker) stop_broker; start_broker ;;
  # topic DIR NAME PARTITIONS: one more topic (tests give each scenario its own).
  topic) topics "${3:?name}:${4:?partitions}" ;;
  *) echo "usage: $0 up|down|status|stop-s3|start-s3|pause-s3|resume-s3|stop-broker|start-broker|restart-broker|kill-broker [DIR] | topic DIR NAME PARTITIONS" >&2; exit 2 ;;
esac
