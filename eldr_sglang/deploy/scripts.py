"""``deploy scripts``: one start script and one stop script per node.

``NODE.sh`` starts the node's servers in the background, each in its own process
group (SGLang spawns scheduler and detokenizer processes), and writes ``NAME PID``
lines to ``LOG_DIR/NODE.pids``. It then waits, within ``ELDR_START_TIMEOUT``
seconds (default 900), until its servers (and, before the router, every server of
the cluster) answer ``/health``; a server of this node that exits meanwhile is named
with the tail of its log, and the node is stopped. Once up it stays in the
foreground: SIGINT or SIGTERM stops every process it started, and so does any of
them exiting (status 1, naming the cause). ``NODE-stop.sh`` stops them from
another shell (SIGTERM to each group, SIGKILL after ``ELDR_STOP_TIMEOUT`` seconds,
default 60); the start script then ends with status 0.
"""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path

from .commands import Launch
from .spec import Cluster

_FUNCTIONS = r'''
PIDS="$LOG_DIR/$NODE.pids"
START_TIMEOUT="${ELDR_START_TIMEOUT:-900}"
mkdir -p "$LOG_DIR"
if [ -s "$PIDS" ]; then
  echo "error: $PIDS lists processes of an earlier start; run $(dirname "$0")/$NODE-stop.sh first" >&2
  exit 1
fi
: > "$PIDS"
rm -f "$LOG_DIR/$NODE.stopping"

stop_all() {
  trap - INT TERM
  local name pid
  while read -r name pid; do
    kill -TERM -- "-$pid" 2> /dev/null || true
  done < "$PIDS"
  local deadline=$((SECONDS + ${ELDR_STOP_TIMEOUT:-60}))
  while read -r name pid; do
    while kill -0 -- "-$pid" 2> /dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.5; done
    kill -KILL -- "-$pid" 2> /dev/null || true
  done < "$PIDS"
  rm -f "$PIDS"
}
trap 'echo "stopping $NODE" >&2; stop_all; exit 130' INT TERM

start() {  # start NAME COMMAND...: its own process group (setsid), output in LOG_DIR/NAME.log
  local name="$1"; shift
  setsid "$@" > "$LOG_DIR/$name.log" 2>&1 < /dev/null &
  echo "$name $!" >> "$PIDS"
  echo "started $name (pid $!, log $LOG_DIR/$name.log)"
}

check_alive() {  # every process of this node still runs; else name it, stop the node, exit 1
  local name pid
  while read -r name pid; do
    if ! kill -0 "$pid" 2> /dev/null; then
      echo "error: $name exited during start-up; the end of $LOG_DIR/$name.log:" >&2
      tail -n 20 "$LOG_DIR/$name.log" >&2 || true
      stop_all
      exit 1
    fi
  done < "$PIDS"
}

wait_healthy() {  # wait_healthy URL...: each answers /health within START_TIMEOUT
  local url
  for url in "$@"; do
    until curl -sf -o /dev/null --max-time 5 "$url/health"; do
      check_alive
      if [ "$SECONDS" -ge "$START_TIMEOUT" ]; then
        echo "error: $url/health did not answer within ${START_TIMEOUT} s (ELDR_START_TIMEOUT)" >&2
        stop_all
        exit 1
      fi
      sleep 2
    done
  done
}
'''.strip("\n")

_STOP = r'''
PIDS="$LOG_DIR/$NODE.pids"
[ -f "$PIDS" ] || { echo "nothing to stop: no $PIDS"; exit 0; }
touch "$LOG_DIR/$NODE.stopping"  # the start script ends with status 0, not as a crash
while read -r name pid; do
  kill -TERM -- "-$pid" 2> /dev/null && echo "stopping $name (pid $pid)"
done < "$PIDS"
deadline=$((SECONDS + ${ELDR_STOP_TIMEOUT:-60}))
while read -r name pid; do
  while kill -0 -- "-$pid" 2> /dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.5; done
  kill -KILL -- "-$pid" 2> /dev/null && echo "killed $name (pid $pid) after ${ELDR_STOP_TIMEOUT:-60} s"
done < "$PIDS"
rm -f "$PIDS"
'''.strip("\n")


def _start_line(launch: Launch) -> str:
    env = ["env", *(f"{k}={v}" for k, v in launch.env)] if launch.env else []
    return "start " + " ".join(map(shlex.quote, [launch.name, *env, *launch.argv]))


def _header(cluster: Cluster, node_name: str, host: str, what: str) -> list[str]:
    return ["#!/usr/bin/env bash", f"# {cluster.name}: {what} on {node_name} ({host})", "set -uo pipefail",
            f"NODE={shlex.quote(node_name)}", f"LOG_DIR={shlex.quote(cluster.log_dir)}"]


def start_script(cluster: Cluster, node_name: str, launches: list[Launch]) -> str:
    """The start script of one node (see the module docstring)."""
    node = cluster.node(node_name)
    mine = [l for l in launches if l.node == node_name]
    servers = [l for l in mine if l.name != "router"]
    body = [*_header(cluster, node_name, node.host, "start the servers"),
            *(f"# WARNING: {w}" for w in cluster.warnings), _FUNCTIONS, ""]
    body += [_start_line(l) for l in servers]
    if servers:
        body.append("wait_healthy " + " ".join(l.url for l in servers))
    router = next((l for l in mine if l.name == "router"), None)
    if router is not None:
        others = [l.url for l in launches if l.name != "router" and l.node != node_name]
        if others:
            body += ["# the router starts once every server of the cluster answers /health",
                     "wait_healthy " + " ".join(others)]
        body += [_start_line(router), f"wait_healthy {router.url}"]
    body += [f'echo "{node_name} is up ({len(mine)} processes); stop: $(dirname "$0")/{node_name}-stop.sh '
             'or Ctrl-C"',
             "wait -n",
             'if [ -e "$LOG_DIR/$NODE.stopping" ]; then rm -f "$LOG_DIR/$NODE.stopping"; '
             'echo "$NODE stopped"; exit 0; fi',
             "echo \"error: a process of $NODE exited; stopping the others\" >&2",
             "stop_all", "exit 1"]
    return "\n".join(body) + "\n"


def stop_script(cluster: Cluster, node_name: str) -> str:
    node = cluster.node(node_name)
    return "\n".join([*_header(cluster, node_name, node.host, "stop what the start script started"),
                      _STOP]) + "\n"


def write_scripts(cluster: Cluster, launches: list[Launch], out: str | os.PathLike) -> list[Path]:
    """``NODE.sh`` and ``NODE-stop.sh`` per node that runs something."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for node in cluster.nodes:
        mine = [l for l in launches if l.node == node.name]
        if not mine:
            continue
        for name, text in ((f"{node.name}.sh", start_script(cluster, node.name, launches)),
                           (f"{node.name}-stop.sh", stop_script(cluster, node.name))):
            path = folder / name
            path.write_text(text)
            path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            paths.append(path)
    return paths
