#!/usr/bin/env bash
# Run one multi-process training job on this machine: PROCS processes joined through
# jax.distributed on 127.0.0.1, each simulating DEVICES_PER_PROC CPU devices.
#
#   scripts/launch_local.sh PROCS DEVICES_PER_PROC [train] [CONFIG.yaml ...] [key=value ...]
#
# Each output line starts with "[i] ", the index of the process that wrote it. If a process
# fails, the others get SIGTERM and, GRACE_S (default 10) seconds later, SIGKILL: a peer stuck
# in a collective with a dead process never returns by itself. The exit status is the first
# failure's, else 75 when the run stopped early after saving (every process agrees on the step;
# run the same command again to resume), else 0. SIGTERM to the launcher is passed on (the
# processes save a checkpoint and stop); Ctrl-C reaches them from the terminal directly.
# Environment: MESHTRAIN (default: meshtrain) is the command, PORT the coordinator port
# (default: a free one), GRACE_S as above.
set -uo pipefail

usage() { echo "usage: $0 PROCS DEVICES_PER_PROC [train] [CONFIG.yaml ...] [key=value ...]" >&2; exit 2; }
[[ $# -ge 2 && $1 =~ ^[1-9][0-9]*$ && $2 =~ ^[1-9][0-9]*$ ]] || usage
procs=$1 devices=$2
shift 2
[[ ${1:-} == train ]] && shift

read -r -a cmd <<< "${MESHTRAIN:-meshtrain}"
if ! command -v "${cmd[0]}" > /dev/null; then
  echo "launch_local: '${cmd[0]}' not found; install meshtrain (pip install -e .) or set MESHTRAIN" >&2
  exit 2
fi
port=${PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
grace=${GRACE_S:-10}
# each process sees its own device count, whatever the caller's XLA_FLAGS said
xla_flags="$(sed -E 's/--xla_force_host_platform_device_count=[^ ]*//g' <<< "${XLA_FLAGS:-}") --xla_force_host_platform_device_count=$devices"

pids=()
for ((i = 0; i < procs; i++)); do
  XLA_FLAGS=$xla_flags JAX_PLATFORMS=cpu "${cmd[@]}" train "$@" \
    dist.coordinator="127.0.0.1:$port" dist.num_processes="$procs" dist.process_id="$i" \
    > >(awk -v p="[$i] " '{ print p $0; fflush() }') 2>&1 &
  pids[i]=$!
done

stop_all() {  # SIGTERM the processes still running, then SIGKILL after the grace period
  local pid t
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2> /dev/null; done
  for ((t = 0; t < grace * 5; t++)); do
    local running=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2> /dev/null && running=1; done
    ((running)) || break
    sleep 0.2
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2> /dev/null; done
  wait 2> /dev/null
}

trap 'for pid in "${pids[@]}"; do kill -TERM "$pid" 2> /dev/null; done' TERM
trap ':' INT

stopped_early=75  # trainer/cli.py STOPPED_EARLY: saved before train.steps, resumable; not a failure
final=0
alive=("${!pids[@]}")
while ((${#alive[@]})); do
  still=()
  for i in "${alive[@]}"; do
    if kill -0 "${pids[i]}" 2> /dev/null; then
      still+=("$i")
      continue
    fi
    wait "${pids[i]}"
    rc=$?
    if ((rc == stopped_early)); then
      final=$rc
    elif ((rc != 0)); then
      echo "launch_local: process $i exited with status $rc; stopping the other processes" >&2
      unset 'pids[i]'
      stop_all
      exit "$rc"
    fi
  done
  alive=("${still[@]+"${still[@]}"}")
  sleep 0.2
done
wait  # the log prefixers
((final == 0)) || echo "launch_local: the run stopped early after saving a checkpoint; run the same command to resume" >&2
exit "$final"

