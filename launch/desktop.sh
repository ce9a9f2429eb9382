#!/usr/bin/env bash
# A local "mini-OSWorld" desktop: no VM, just this host's X server stack.
#
#   bash launch/desktop.sh start|stop|status [--display N] [--port P]
#       [--size WxH] [--home DIR] [--python PATH] [--run-dir DIR]
#
# start: Xvfb :N (WxH, 24-bit, no TCP), a D-Bus session bus, the AT-SPI
# accessibility bus, openbox, and rla_jax/envs/osworld/desktop_server.py (the
# OSWorld controller's HTTP API) on 127.0.0.1:P only; returns once the
# server answers GET /platform. Apps started through the server run with
# HOME=DIR; `python` in their commands is --python (default: the repo's
# .venv/bin/python, which has pyautogui). stop: ends every process of this
# desktop (idempotent). status: exit 0 when the server answers, 3 if not.
#
# Defaults: --display 99 --port 5000 --size 1280x800, --run-dir
# /tmp/rla_desktop_<N> (pid files, logs, the X cookie, the port for stop
# and status), --home <run dir>/home. Every process started here carries
# RLA_DESKTOP_RUN=<run dir> in its environment, so stop finds them all
# (the apps too), and desktops with different displays, ports and run dirs
# run side by side. The apps run under bubblewrap (the host read-only but
# for --home and the run dir). Needs: bubblewrap xvfb openbox dbus-x11 at-spi2-core
# python3-pyatspi python3-xlib python3-pil (.ci/run installs them).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
usage() {
  echo "usage: $0 start|stop|status [--display N] [--port P] [--size WxH]" \
       "[--home DIR] [--python PATH] [--run-dir DIR]" >&2
  exit 2
}
[ $# -ge 1 ] || usage
ACTION=$1
shift
DISPLAY_NUM=99 PORT= SIZE=1280x800 HOME_DIR= PYTHON= RUN_DIR=
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || usage
  case "$1" in
    --display) DISPLAY_NUM=$2 ;;
    --port) PORT=$2 ;;
    --size) SIZE=$2 ;;
    --home) HOME_DIR=$2 ;;
    --python) PYTHON=$2 ;;
    --run-dir) RUN_DIR=$2 ;;
    *) usage ;;
  esac
  shift 2
done
[[ $DISPLAY_NUM =~ ^[0-9]+$ ]] || { echo "desktop.sh: --display must be a number, got '$DISPLAY_NUM'" >&2; exit 2; }
[[ ${PORT:-0} =~ ^[0-9]+$ ]] || { echo "desktop.sh: --port must be a number, got '$PORT'" >&2; exit 2; }
[[ $SIZE =~ ^[0-9]+x[0-9]+$ ]] || { echo "desktop.sh: --size must be WxH (e.g. 1280x800), got '$SIZE'" >&2; exit 2; }
RUN_DIR=$(realpath -m "${RUN_DIR:-/tmp/rla_desktop_$DISPLAY_NUM}")
HOME_DIR=${HOME_DIR:-$RUN_DIR/home}
# stop and status find the port of the desktop started from this run dir.
[ -n "$PORT" ] || PORT=$(cat "$RUN_DIR/port" 2>/dev/null || echo 5000)
# The AT-SPI bus socket lands in the run dir: unix socket paths are short.
[ ${#RUN_DIR} -le 80 ] || { echo "desktop.sh: --run-dir $RUN_DIR is too long (over 80 characters; the accessibility bus socket lives in it)" >&2; exit 2; }
SYSTEM_PYTHON=${RLA_DESKTOP_SYSTEM_PYTHON:-/usr/bin/python3}
TAG="RLA_DESKTOP_RUN=$RUN_DIR"
SERVICES=(server openbox atspi dbus xvfb)  # stop order

# Pids of every process whose environment carries this desktop's tag.
tagged_pids() {
  local f pid
  for f in /proc/[0-9]*/environ; do
    pid=${f#/proc/}
    pid=${pid%/environ}
    [ "$pid" != $$ ] && [ "$pid" != "$BASHPID" ] || continue
    grep -qzxF "$TAG" "$f" 2>/dev/null && echo "$pid"
  done
  return 0
}

# A live process (a zombie is not: PID 1 of a container may never reap it).
alive() {
  [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null &&
    ! grep -q '^State:.*Z' "/proc/$1/status" 2>/dev/null
}
pid_of() { cat "$RUN_DIR/$1.pid" 2>/dev/null || true; }

# Answers GET /platform on 127.0.0.1:PORT (bash's /dev/tcp, no curl needed).
answers() {
  local line
  { exec 3<>"/dev/tcp/127.0.0.1/$PORT"; } 2>/dev/null || return 1
  printf 'GET /platform HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  IFS= read -r -t 2 line <&3 || line=
  exec 3<&- 3>&-
  [[ $line == "HTTP/"*" 200"* ]]
}

# Sends TERM (then KILL after ~3 s) to pids and their process groups.
end_all() {
  local pids=("$@") pid i
  [ ${#pids[@]} -gt 0 ] || return 0
  for pid in "${pids[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null || true
    kill -TERM "$pid" 2>/dev/null || true
  done
  for ((i = 0; i < 30; i++)); do
    local left=()
    for pid in "${pids[@]}"; do
      alive "$pid" && left+=("$pid")
    done
    [ ${#left[@]} -gt 0 ] || return 0
    pids=("${left[@]}")
    sleep 0.1
  done
  for pid in "${pids[@]}"; do
    kill -KILL -- "-$pid" 2>/dev/null || true
    kill -KILL "$pid" 2>/dev/null || true
  done
}

stop_desktop() {
  local pids=() name pid
  for name in "${SERVICES[@]}"; do
    pid=$(pid_of "$name")
    alive "$pid" && pids+=("$pid")
  done
  # The server first: it ends the apps it started.
  end_all "${pids[@]+"${pids[@]}"}"
  mapfile -t pids < <(tagged_pids)
  end_all "${pids[@]+"${pids[@]}"}"
  for name in "${SERVICES[@]}"; do rm -f "$RUN_DIR/$name.pid"; done
  # Xvfb removes its lock and socket on TERM; after a KILL they stay.
  local lock=/tmp/.X$DISPLAY_NUM-lock
  if [ -f "$lock" ] && ! alive "$(tr -d ' ' < "$lock" 2>/dev/null)"; then
    rm -f "$lock" "/tmp/.X11-unix/X$DISPLAY_NUM"
  fi
}

die() {
  echo "desktop.sh: $1" >&2
  exit 1
}

# A start that went wrong: says why, ends what it started.
fail() {
  echo "desktop.sh: $1" >&2
  if [ -n "${2:-}" ] && [ -f "$2" ]; then
    echo "--- last lines of $2:" >&2
    tail -n 15 "$2" >&2
  fi
  stop_desktop
  exit 1
}

# Waits up to $2 seconds for the command $3... to succeed.
wait_for() {
  local what=$1 seconds=$2 i
  shift 2
  for ((i = 0; i < seconds * 20; i++)); do
    "$@" && return 0
    sleep 0.05
  done
  return 1
}

find_atspi_launcher() {
  local c
  for c in /usr/libexec/at-spi-bus-launcher \
           /usr/lib/at-spi2-core/at-spi-bus-launcher \
           /usr/lib/*/at-spi2-core/at-spi-bus-launcher \
           /usr/libexec/at-spi2-core/at-spi-bus-launcher \
           /usr/lib/at-spi2/at-spi-bus-launcher \
           "$(command -v at-spi-bus-launcher 2>/dev/null || true)"; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}

x_answers() { xprop -root -display "$DISPLAY" >/dev/null 2>&1; }

display_in_use() {
  local lock=/tmp/.X$DISPLAY_NUM-lock
  [ -f "$lock" ] && alive "$(tr -d ' ' < "$lock" 2>/dev/null)" && return 0
  [ -S "/tmp/.X11-unix/X$DISPLAY_NUM" ] &&
    xprop -root -display ":$DISPLAY_NUM" >/dev/null 2>&1
}

start_desktop() {
  local pid name
  for name in "${SERVICES[@]}"; do
    alive "$(pid_of "$name")" && die "a desktop already runs from $RUN_DIR ($name pid $(pid_of "$name")); run '$0 stop --run-dir $RUN_DIR' first"
  done
  display_in_use && die "display :$DISPLAY_NUM is in use (/tmp/.X$DISPLAY_NUM-lock); pick another --display"
  answers && die "something already answers on 127.0.0.1:$PORT; pick another --port"
  command -v Xvfb >/dev/null || die "Xvfb is not installed (apt-get install xvfb openbox dbus-x11 at-spi2-core python3-pyatspi python3-xlib python3-pil)"
  command -v openbox >/dev/null || die "openbox is not installed (apt-get install openbox)"
  command -v dbus-launch >/dev/null || die "dbus-launch is not installed (apt-get install dbus-x11)"
  local launcher
  launcher=$(find_atspi_launcher) || die "at-spi-bus-launcher not found (apt-get install at-spi2-core)"
  "$SYSTEM_PYTHON" -c 'import pyatspi, Xlib, PIL' 2>/dev/null || die "$SYSTEM_PYTHON cannot import pyatspi, Xlib and PIL (apt-get install python3-pyatspi python3-xlib python3-pil)"
  if [ -z "$PYTHON" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=$(command -v python3); fi
  fi

  mkdir -p "$RUN_DIR"
  chmod 700 "$RUN_DIR"
  rm -f "$RUN_DIR"/*.log
  mkdir -p "$RUN_DIR/runtime" "$RUN_DIR/infra_home" "$HOME_DIR"
  chmod 700 "$RUN_DIR/runtime"
  # A cookie of its own when xauth is there (only this desktop's processes
  # may connect); else an empty file, which is enough for Xlib.
  echo "$PORT" > "$RUN_DIR/port"
  : > "$RUN_DIR/Xauthority"
  if command -v xauth >/dev/null; then
    xauth -q -f "$RUN_DIR/Xauthority" add ":$DISPLAY_NUM" . \
      "$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
  fi
  export RLA_DESKTOP_RUN=$RUN_DIR DISPLAY=":$DISPLAY_NUM"
  export XAUTHORITY=$RUN_DIR/Xauthority XDG_SESSION_TYPE=x11
  export XDG_RUNTIME_DIR=$RUN_DIR/runtime HOME=$RUN_DIR/infra_home
  export QT_ACCESSIBILITY=1 QT_LINUX_ACCESSIBILITY_ALWAYS_ON=1
  unset DBUS_SESSION_BUS_ADDRESS AT_SPI_BUS_ADDRESS SESSION_MANAGER NO_AT_BRIDGE

  setsid Xvfb "$DISPLAY" -screen 0 "${SIZE}x24" -nolisten tcp -noreset -auth "$XAUTHORITY" \
    > "$RUN_DIR/xvfb.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/xvfb.pid"
  wait_for Xvfb 10 eval 'x_answers || ! alive "$(pid_of xvfb)"'
  alive "$(pid_of xvfb)" && x_answers ||
    fail "Xvfb $DISPLAY did not start" "$RUN_DIR/xvfb.log"

  local bus
  bus=$(env -u DISPLAY dbus-launch --sh-syntax 2> "$RUN_DIR/dbus.log") ||
    fail "dbus-launch failed" "$RUN_DIR/dbus.log"
  DBUS_SESSION_BUS_ADDRESS=$(sed -n "s/^DBUS_SESSION_BUS_ADDRESS='\(.*\)';$/\1/p" <<< "$bus")
  sed -n 's/^DBUS_SESSION_BUS_PID=\([0-9]*\);$/\1/p' <<< "$bus" > "$RUN_DIR/dbus.pid"
  [ -n "$DBUS_SESSION_BUS_ADDRESS" ] || fail "dbus-launch printed no bus address: $bus"
  export DBUS_SESSION_BUS_ADDRESS

  setsid "$launcher" --launch-immediately > "$RUN_DIR/atspi.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/atspi.pid"
  setsid openbox --sm-disable > "$RUN_DIR/openbox.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/openbox.pid"
  # Apps that start before the WM manages the screen get no decorations or
  # focus; before the a11y bus is up they expose no accessibility tree.
  wait_for openbox 10 eval 'xprop -root _NET_SUPPORTING_WM_CHECK 2>/dev/null | grep -q "window id"' ||
    fail "openbox did not take the screen" "$RUN_DIR/openbox.log"
  if command -v dbus-send >/dev/null; then
    wait_for atspi 10 eval 'dbus-send --session --print-reply --dest=org.freedesktop.DBus / org.freedesktop.DBus.NameHasOwner string:org.a11y.Bus 2>/dev/null | grep -q true' ||
      fail "the accessibility bus did not start" "$RUN_DIR/atspi.log"
  fi

  setsid "$SYSTEM_PYTHON" "$REPO/rla_jax/envs/osworld/desktop_server.py" --host 127.0.0.1 \
    --port "$PORT" --home "$HOME_DIR" --python "$PYTHON" \
    > "$RUN_DIR/server.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/server.pid"
  wait_for server 20 eval 'answers || ! alive "$(pid_of server)"'
  alive "$(pid_of server)" && answers ||
    fail "the desktop server did not answer on 127.0.0.1:$PORT within 20 s" "$RUN_DIR/server.log"
  echo "desktop $DISPLAY up: http://127.0.0.1:$PORT, home $HOME_DIR, logs in $RUN_DIR"
}

case "$ACTION" in
  start) start_desktop ;;
  stop) stop_desktop ;;
  status)
    if answers && alive "$(pid_of server)"; then
      echo "desktop :$DISPLAY_NUM running: http://127.0.0.1:$PORT (run dir $RUN_DIR)"
    else
      echo "desktop :$DISPLAY_NUM not running (run dir $RUN_DIR)"
      exit 3
    fi ;;
  *) usage ;;
esac
