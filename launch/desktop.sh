#!/usr/bin/env bash
# A local "mini-OSWorld" desktop: no VM, just this host's X server stack.
#
#   bash launch/desktop.sh start|stop|status [--display N] [--size WxH]
#       [--home DIR] [--python PATH] [--run-dir DIR] [--owner-pid PID]
#       [--uid UID]
#
# start: Xvfb :N (WxH, 24-bit, no TCP), a D-Bus session bus, the AT-SPI
# accessibility bus, openbox, and rla_jax/envs/osworld/desktop_server.py (the
# OSWorld controller's HTTP API) on the unix socket <run dir>/server.sock
# (no TCP: the run dir is ours and 0700, so no other uid can reach it, nor
# put a socket of its own there); returns once the server answers GET
# /platform. Apps started through the server run with HOME=DIR; `python`
# in their commands is --python (default: the repo's .venv/bin/python,
# which has pyautogui). With --owner-pid, a watcher stops the desktop
# within a second of that process ending (even by SIGKILL; its start time
# is compared, so a reused pid does not count). stop: ends every process
# of this desktop (idempotent). status: exit 0 when the server answers, 3
# if not.
#
# Defaults: --display 99 --size 1280x800, --run-dir /tmp/rla_desktop_<N>
# (the socket, pid files, logs, the X cookie; created 0700, and refused if
# it exists but is another uid's or open to group or others), --home <run
# dir>/home. Every process started here carries RLA_DESKTOP_RUN=<run dir>
# in its environment, so stop finds them all (the apps too), and desktops
# with different displays and run dirs run side by side. The apps run
# under bubblewrap, a jail per command (desktop_jail.py).
#
# Started by root, the desktop runs as an unprivileged uid of its own
# (--uid, default 1500000000 + N; no account needed): a user namespace
# that root creates maps its uid 1000 to that uid, and every process of
# the desktop joins it as uid 1000 with no capability and no_new_privs,
# in a mount namespace root made for it (bwrap): the system read-only, a
# private /tmp but for the X socket dir, the apps' python and the server's
# code read-only, and two writable folders: <run dir>/desk (the buses,
# the X cookie, the server's state; at /run/rla/desk) and the home (at
# /run/rla/home, chowned to that uid). Root keeps the run dir itself (pid
# files, logs, the socket, which root binds and hands to the server), so
# nothing the desktop's uid can write is read by root, and stop ends
# every process of that uid. Needs: bubblewrap xvfb openbox dbus-x11
# at-spi2-core python3-pyatspi python3-xlib python3-pil, and util-linux's
# unshare, nsenter and setpriv (.ci/run installs them).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
usage() {
  echo "usage: $0 start|stop|status [--display N] [--size WxH]" \
       "[--home DIR] [--python PATH] [--run-dir DIR] [--owner-pid PID]" \
       "[--uid UID]" >&2
  exit 2
}
[ $# -ge 1 ] || usage
ACTION=$1
shift
DISPLAY_NUM=99 SIZE=1280x800 HOME_DIR= PYTHON= RUN_DIR= OWNER_PID= OWNER_START= DESK_UID=
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || usage
  case "$1" in
    --display) DISPLAY_NUM=$2 ;;
    --size) SIZE=$2 ;;
    --home) HOME_DIR=$2 ;;
    --python) PYTHON=$2 ;;
    --run-dir) RUN_DIR=$2 ;;
    --owner-pid) OWNER_PID=$2 ;;
    --uid) DESK_UID=$2 ;;
    --owner-start) OWNER_START=$2 ;;  # internal: the watcher's
    *) usage ;;
  esac
  shift 2
done
[[ $DISPLAY_NUM =~ ^[0-9]+$ ]] || { echo "desktop.sh: --display must be a number, got '$DISPLAY_NUM'" >&2; exit 2; }
[[ ${OWNER_PID:-0} =~ ^[0-9]+$ ]] || { echo "desktop.sh: --owner-pid must be a number, got '$OWNER_PID'" >&2; exit 2; }
[[ ${DESK_UID:-1} =~ ^[1-9][0-9]*$ ]] && (( ${DESK_UID:-1} < 4294967295 )) || { echo "desktop.sh: --uid must be a uid above 0, got '$DESK_UID'" >&2; exit 2; }
[[ $SIZE =~ ^[0-9]+x[0-9]+$ ]] || { echo "desktop.sh: --size must be WxH (e.g. 1280x800), got '$SIZE'" >&2; exit 2; }
# A symlink in place of the run dir or the home may be another user's
# (planted in /tmp): it would send our files, or a root desktop's chown,
# wherever it points.
for given in "${RUN_DIR:-/tmp/rla_desktop_$DISPLAY_NUM}" "$HOME_DIR"; do
  [ -n "$given" ] && [ -L "${given%/}" ] &&
    { echo "desktop.sh: refusing $given: it is a symlink (another user's, perhaps); give the folder itself" >&2; exit 2; }
done
RUN_DIR=$(realpath -m "${RUN_DIR:-/tmp/rla_desktop_$DISPLAY_NUM}")
HOME_DIR=${HOME_DIR:-$RUN_DIR/home}
SOCK=$RUN_DIR/server.sock
# The AT-SPI bus socket lands in the run dir: unix socket paths are short.
[ ${#RUN_DIR} -le 80 ] || { echo "desktop.sh: --run-dir $RUN_DIR is too long (over 80 characters; the accessibility bus socket lives in it)" >&2; exit 2; }
SYSTEM_PYTHON=${RLA_DESKTOP_SYSTEM_PYTHON:-/usr/bin/python3}
TAG="RLA_DESKTOP_RUN=$RUN_DIR"
SERVICES=(watch server openbox atspi dbus xvfb userns)  # stop order
AS_ROOT=$([ "$(id -u)" = 0 ] && echo 1 || true)
if [ -n "$AS_ROOT" ]; then
  # stop and status use the uid that start recorded
  [ -n "$DESK_UID" ] || DESK_UID=$(cat "$RUN_DIR/uid" 2>/dev/null || echo $((1500000000 + DISPLAY_NUM)))
fi

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

# Pids of every process running as the desktop's uid (root's desktops).
uid_pids() {
  local f key value state
  for f in /proc/[0-9]*/status; do
    state=
    while read -r key value _; do
      case $key in
        State:) state=$value ;;
        Uid:) [ "$value" = "$DESK_UID" ] && [ "$state" != Z ] &&
                { f=${f#/proc/}; echo "${f%/status}"; }
              break ;;
      esac
    done 2>/dev/null < "$f" || true
  done
  return 0
}

# A live process (a zombie is not: PID 1 of a container may never reap it).
alive() {
  [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null &&
    ! grep -q '^State:.*Z' "/proc/$1/status" 2>/dev/null
}
pid_of() { cat "$RUN_DIR/$1.pid" 2>/dev/null || true; }

# The run dir, if it exists, is a directory of ours closed to others: only
# then is its socket our server's (no other uid can have bound it).
check_run_dir() {
  [ -e "$RUN_DIR" ] || return 0
  local owner mode
  read -r owner mode < <(stat -c '%u %a' -- "$RUN_DIR")
  if [ ! -d "$RUN_DIR" ] || [ "$owner" != "$(id -u)" ] || (( 8#$mode & 8#077 )); then
    echo "desktop.sh: refusing run dir $RUN_DIR: it must be a directory of uid $(id -u) closed to others (mode 700), it is owner uid $owner, mode $mode; remove it or pick another --run-dir" >&2
    exit 1
  fi
}

# Answers GET /platform on $SOCK (bash cannot speak AF_UNIX: python does).
ANSWERS_PY='import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(2)
try:
  s.connect(sys.argv[1])
  s.sendall(b"GET /platform HTTP/1.0\r\nHost: desktop\r\n\r\n")
  line = b""
  while b"\r\n" not in line and len(line) < 200:
    chunk = s.recv(200)
    if not chunk:
      break
    line += chunk
except OSError:
  sys.exit(1)
sys.exit(0 if line.split(b" ")[1:2] == [b"200"] else 1)'
answers() {
  [ -S "$SOCK" ] && timeout 5 "$SYSTEM_PYTHON" -c "$ANSWERS_PY" "$SOCK" 2>/dev/null
}

# The start time (field 22 of /proc/PID/stat) of a live process; fails for a
# process that is gone or a zombie.
start_time_of() {
  local stat fields
  read -r stat 2>/dev/null < "/proc/$1/stat" || return 1
  read -r -a fields <<< "${stat##*) }"
  [[ ${fields[0]} != [ZX] ]] || return 1
  echo "${fields[19]}"
}

# The watcher: stops this desktop once the owner process is gone.
watch_owner() {
  while [ "$(start_time_of "$OWNER_PID" || true)" = "$OWNER_START" ]; do
    sleep 0.5
  done
  echo "owner pid $OWNER_PID is gone: stopping the desktop"
  exec env -u RLA_DESKTOP_RUN bash "$REPO/launch/desktop.sh" stop \
    --display "$DISPLAY_NUM" --run-dir "$RUN_DIR"
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
    # ($$: the watcher, stopping the desktop after its owner died)
    alive "$pid" && [ "$pid" != $$ ] && pids+=("$pid")
  done
  # The server first: it ends the apps it started.
  end_all "${pids[@]+"${pids[@]}"}"
  mapfile -t pids < <(tagged_pids)
  end_all "${pids[@]+"${pids[@]}"}"
  if [ -n "$AS_ROOT" ]; then  # however they detached or dropped the tag
    mapfile -t pids < <(uid_pids)
    end_all "${pids[@]+"${pids[@]}"}"
  fi
  for name in "${SERVICES[@]}"; do rm -f "$RUN_DIR/$name.pid"; done
  rm -f "$SOCK"
  # Xvfb removes its lock and socket on TERM; after a KILL they stay.
  local lock=/tmp/.X$DISPLAY_NUM-lock socket=/tmp/.X11-unix/X$DISPLAY_NUM
  if [ -f "$lock" ] && ! alive "$(tr -d ' ' < "$lock" 2>/dev/null)"; then
    rm -f "$lock" "$socket"
  fi
  if [ -n "$AS_ROOT" ]; then  # its lock was private; the socket is the uid's
    [ -S "$socket" ] && [ "$(stat -c %u "$socket")" = "$DESK_UID" ] && rm -f "$socket"
    rm -rf "$RUN_DIR/desk"
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

# A display whose lock names a live process, or whose socket takes
# connections (a root-started desktop's lock is private; its X server may
# refuse us for want of its cookie, but it accepts the connection).
display_in_use() {
  local lock=/tmp/.X$DISPLAY_NUM-lock socket=/tmp/.X11-unix/X$DISPLAY_NUM
  [ -f "$lock" ] && alive "$(tr -d ' ' < "$lock" 2>/dev/null)" && return 0
  [ -S "$socket" ] && "$SYSTEM_PYTHON" -c "$CONNECTS_PY" "$socket" 2>/dev/null
}
CONNECTS_PY='import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(2)
s.connect(sys.argv[1])'


# The mounts of a root-started desktop: the system read-only, a private
# /tmp with the host's X socket dir, /dev and the host's /proc (so the
# apps' jails can mount their own proc).
INFRA_MOUNTS=()
for path in /usr /etc /bin /sbin /lib /lib32 /lib64 /libx32 /var; do
  if [ -L "$path" ]; then INFRA_MOUNTS+=(--symlink "$(readlink "$path")" "$path")
  elif [ -d "$path" ]; then INFRA_MOUNTS+=(--ro-bind "$path" "$path"); fi
done
INFRA_MOUNTS+=(--perms 1777 --tmpfs /tmp --bind /tmp/.X11-unix /tmp/.X11-unix
               --dev-bind /dev /dev --bind /proc /proc
               --perms 0755 --dir /run --perms 0755 --dir /run/rla)

# OWN_PATHS: bwrap arguments that show each folder read-only at its own
# path, its parents made traversable (0755) where the host's are not
# (/root is 0700): the folders themselves keep their modes.
own_path_binds() {
  local path parent made=" /tmp /run "
  OWN_PATHS=()
  for path in "$@"; do
    [ -d "$path" ] || continue
    parent=
    local part parts
    IFS=/ read -r -a parts <<< "${path#/}"
    for part in "${parts[@]:0:${#parts[@]}-1}"; do
      parent=$parent/$part
      [[ $made == *" $parent "* ]] && continue
      OWN_PATHS+=(--perms 0755 --dir "$parent")
      made+="$parent "
    done
    OWN_PATHS+=(--ro-bind "$path" "$path")
  done
}

# The apps' python's folders (desktop_jail.python_roots).
PYTHON_ROOTS_PY='import sys
sys.path.insert(0, sys.argv[1])
import desktop_jail
print("\n".join(desktop_jail.python_roots(sys.argv[2])))'

# Binds and listens on the unix socket argv[1] (0600), as fd 3, then runs
# the rest of argv with it.
LISTEN_PY='import os, socket, sys
umask = os.umask(0o177)
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
os.umask(umask)
s.listen(64)
if s.fileno() != 3:
  os.dup2(s.fileno(), 3)
os.set_inheritable(3, True)
os.execvp(sys.argv[2], sys.argv[2:])'

# The home a root-started desktop chowns to its uid: refused where a reset
# (which empties it) or the chown would hurt.
check_home() {
  local home real_home
  home=$(realpath -m -- "$HOME_DIR")
  real_home=$(realpath -m -- ~root)
  [ "$(dirname "$home")" != / ] || die "refusing --home $home: a reset empties it; give a directory of its own, not one at the top of the file system"
  for keep in "$REPO" "$real_home" "$RUN_DIR"; do
    [ "$keep" = "$home" ] || [[ $keep == "$home"/* ]] &&
      die "refusing --home $home: it is or contains $keep (a root-started desktop's uid would own it, and a reset empties it)"
  done
  HOME_DIR=$home
}

start_desktop() {
  local pid name
  for name in "${SERVICES[@]}"; do
    alive "$(pid_of "$name")" && die "a desktop already runs from $RUN_DIR ($name pid $(pid_of "$name")); run '$0 stop --run-dir $RUN_DIR' first"
  done
  display_in_use && die "display :$DISPLAY_NUM is in use (/tmp/.X$DISPLAY_NUM-lock); pick another --display"
  answers && die "a desktop server already answers on $SOCK; run '$0 stop --run-dir $RUN_DIR' first"
  if [ -n "$OWNER_PID" ]; then
    OWNER_START=$(start_time_of "$OWNER_PID") || die "--owner-pid $OWNER_PID is not a running process"
  fi
  command -v Xvfb >/dev/null || die "Xvfb is not installed (apt-get install xvfb openbox dbus-x11 at-spi2-core python3-pyatspi python3-xlib python3-pil)"
  command -v openbox >/dev/null || die "openbox is not installed (apt-get install openbox)"
  command -v dbus-launch >/dev/null || die "dbus-launch is not installed (apt-get install dbus-x11)"
  local launcher
  launcher=$(find_atspi_launcher) || die "at-spi-bus-launcher not found (apt-get install at-spi2-core)"
  "$SYSTEM_PYTHON" -c 'import pyatspi, Xlib, PIL' 2>/dev/null || die "$SYSTEM_PYTHON cannot import pyatspi, Xlib and PIL (apt-get install python3-pyatspi python3-xlib python3-pil)"
  if [ -z "$PYTHON" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=$(command -v python3); fi
  fi

  mkdir -p -m 700 "$RUN_DIR"
  check_run_dir  # again: it may have appeared since
  rm -f "$RUN_DIR"/*.log "$SOCK"
  # STATE: the buses' runtime dir, the infrastructure's HOME, the X cookie
  # and the server's state, as the desktop sees them (SEEN_*) and here.
  local state=$RUN_DIR seen_state=$RUN_DIR seen_home=$HOME_DIR
  local server_dir=$REPO/rla_jax/envs/osworld
  if [ -n "$AS_ROOT" ]; then
    check_home
    [ -z "$(uid_pids)" ] || die "uid $DESK_UID already runs processes (another desktop's?); stop it or pick another --uid"
    state=$RUN_DIR/desk seen_state=/run/rla/desk seen_home=/run/rla/home
    rm -rf "$state"  # made afresh by root: nothing in it is the uid's yet
    mkdir -m 700 "$state"
    echo "$DESK_UID" > "$RUN_DIR/uid"
  fi
  mkdir -p "$state/runtime" "$state/infra_home" "$HOME_DIR"
  chmod 700 "$state/runtime"
  if [ -n "$AS_ROOT" ]; then  # ours (or the desktop's), not another user's
    local owner
    owner=$(stat -c %u -- "$HOME_DIR")
    [ "$owner" = 0 ] || [ "$owner" = "$DESK_UID" ] ||
      die "refusing --home $HOME_DIR: it belongs to uid $owner, and a root-started desktop would hand it to uid $DESK_UID"
  fi
  # A cookie of its own when xauth is there (only this desktop's processes
  # may connect); else an empty file, which is enough for Xlib.
  # (Ours in the run dir; the desktop's copy in its state dir.)
  : > "$RUN_DIR/Xauthority"
  if command -v xauth >/dev/null; then
    xauth -q -f "$RUN_DIR/Xauthority" add ":$DISPLAY_NUM" . \
      "$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
  fi
  [ "$state" = "$RUN_DIR" ] || cp "$RUN_DIR/Xauthority" "$state/Xauthority"
  # The session bus listens in the runtime dir (not in /tmp, which root's
  # desktops do not share), with the standard session policy.
  cat > "$state/session.conf" <<CONF
<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <keep_umask/>
  <listen>unix:dir=$seen_state/runtime</listen>
  <auth>EXTERNAL</auth>
  <standard_session_servicedirs/>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
CONF
  OUTER=()
  if [ -n "$AS_ROOT" ]; then
    for name in bwrap unshare nsenter setpriv; do
      command -v $name >/dev/null || die "$name is not installed (apt-get install bubblewrap util-linux)"
    done
    # The host's X socket dir, which the mount namespace binds. Xvfb makes
    # it on first use, so on a machine that has never run X it is missing;
    # where an ordinary user's X server made it, that user could delete and
    # replace this desktop's socket in it: root takes it over (sticky /tmp
    # then keeps its owner from renaming it).
    mkdir -p -m 1777 /tmp/.X11-unix 2>/dev/null || true
    [ -L /tmp/.X11-unix ] || chown -h 0:0 /tmp/.X11-unix 2>/dev/null || true
    [ -d /tmp/.X11-unix ] && [ ! -L /tmp/.X11-unix ] &&
      [ "$(stat -c %u /tmp/.X11-unix)" = 0 ] ||
      die "/tmp/.X11-unix is not a directory root owns (a symlink, or another user's); remove it while no X server runs"
    chmod 1777 /tmp/.X11-unix
    local why
    why=$(bwrap "${INFRA_MOUNTS[@]}" -- true 2>&1) ||
      die "root's bwrap cannot make the desktop's mount namespace ($why); a container without CAP_SYS_ADMIN cannot: start the trainer as an ordinary user there"
    # passwd and group: the host's, with uid and gid 1000 named 'user',
    # without the tty group (xterm cannot hand its pty to an unmapped group)
    grep -v '^[^:]*:[^:]*:1000:' /etc/passwd > "$RUN_DIR/passwd"
    echo "user:x:1000:1000:user:/home/user:/bin/sh" >> "$RUN_DIR/passwd"
    grep -v '^tty:\|^[^:]*:[^:]*:1000:' /etc/group > "$RUN_DIR/group"
    echo "user:x:1000:" >> "$RUN_DIR/group"
    chown -R "$DESK_UID:$DESK_UID" "$state" "$HOME_DIR"
    # The user namespace, held by a process of root's: uid 1000 in it is
    # DESK_UID here, and no other uid is mapped.
    setsid unshare --user sleep infinity < /dev/null > /dev/null 2>&1 &
    echo $! > "$RUN_DIR/userns.pid"
    wait_for userns 5 eval '[ "$(readlink /proc/$(pid_of userns)/ns/user)" != "$(readlink /proc/self/ns/user)" ]' ||
      fail "unshare --user did not make a user namespace"
    echo "1000 $DESK_UID 1" > "/proc/$(pid_of userns)/uid_map" &&
      echo "1000 $DESK_UID 1" > "/proc/$(pid_of userns)/gid_map" ||
      fail "cannot map uid 1000 of the desktop's user namespace to $DESK_UID"
    OUTER=(bwrap "${INFRA_MOUNTS[@]}"
           --ro-bind "$RUN_DIR/passwd" /etc/passwd --ro-bind "$RUN_DIR/group" /etc/group
           --bind "$state" "$seen_state" --bind "$HOME_DIR" "$seen_home")
    own_path_binds "$server_dir" $("$SYSTEM_PYTHON" -c "$PYTHON_ROOTS_PY" "$server_dir" "$PYTHON")
    OUTER+=("${OWN_PATHS[@]}"
            --setenv XAUTHORITY "$seen_state/Xauthority" --setenv XDG_RUNTIME_DIR "$seen_state/runtime"
            --setenv HOME "$seen_state/infra_home" --setenv RLA_DESKTOP_STATE "$seen_state"
            -- nsenter "--user=/proc/$(pid_of userns)/ns/user" --setuid 1000 --setgid 1000
            -- setpriv --no-new-privs --inh-caps=-all --)
  fi
  export RLA_DESKTOP_RUN=$RUN_DIR RLA_DESKTOP_STATE=$state DISPLAY=":$DISPLAY_NUM"
  export XAUTHORITY=$RUN_DIR/Xauthority XDG_SESSION_TYPE=x11
  export XDG_RUNTIME_DIR=$state/runtime HOME=$state/infra_home
  export QT_ACCESSIBILITY=1 QT_LINUX_ACCESSIBILITY_ALWAYS_ON=1
  unset DBUS_SESSION_BUS_ADDRESS AT_SPI_BUS_ADDRESS SESSION_MANAGER NO_AT_BRIDGE

  setsid "${OUTER[@]}" Xvfb "$DISPLAY" -screen 0 "${SIZE}x24" -nolisten tcp -noreset -auth "$seen_state/Xauthority" \
    > "$RUN_DIR/xvfb.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/xvfb.pid"
  wait_for Xvfb 10 eval 'x_answers || ! alive "$(pid_of xvfb)"'
  alive "$(pid_of xvfb)" && x_answers ||
    fail "Xvfb $DISPLAY did not start" "$RUN_DIR/xvfb.log"

  local bus
  bus=$(env -u DISPLAY "${OUTER[@]}" dbus-launch --sh-syntax --config-file="$seen_state/session.conf" 2> "$RUN_DIR/dbus.log") ||
    fail "dbus-launch failed" "$RUN_DIR/dbus.log"
  DBUS_SESSION_BUS_ADDRESS=$(sed -n "s/^DBUS_SESSION_BUS_ADDRESS='\(.*\)';$/\1/p" <<< "$bus")
  sed -n 's/^DBUS_SESSION_BUS_PID=\([0-9]*\);$/\1/p' <<< "$bus" > "$RUN_DIR/dbus.pid"
  [ -n "$DBUS_SESSION_BUS_ADDRESS" ] || fail "dbus-launch printed no bus address: $bus"
  export DBUS_SESSION_BUS_ADDRESS

  setsid "${OUTER[@]}" "$launcher" --launch-immediately > "$RUN_DIR/atspi.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/atspi.pid"
  setsid "${OUTER[@]}" openbox --sm-disable > "$RUN_DIR/openbox.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/openbox.pid"
  # Apps that start before the WM manages the screen get no decorations or
  # focus; before the a11y bus is up they expose no accessibility tree.
  wait_for openbox 10 eval 'xprop -root _NET_SUPPORTING_WM_CHECK 2>/dev/null | grep -q "window id"' ||
    fail "openbox did not take the screen" "$RUN_DIR/openbox.log"
  if command -v dbus-send >/dev/null; then
    wait_for atspi 10 eval '"${OUTER[@]}" dbus-send --session --print-reply --dest=org.freedesktop.DBus / org.freedesktop.DBus.NameHasOwner string:org.a11y.Bus 2>/dev/null | grep -q true' ||
      fail "the accessibility bus did not start" "$RUN_DIR/atspi.log"
  fi

  # Root binds the socket in its run dir and hands it to the server (fd 3):
  # the desktop's uid can neither enter that dir nor replace the socket.
  local listen=() listen_fd=()
  if [ -n "$AS_ROOT" ]; then
    listen=("$SYSTEM_PYTHON" -c "$LISTEN_PY" "$SOCK")
    listen_fd=(--listen-fd 3 --trainer-home "$HOME_DIR")
  fi
  setsid "${listen[@]}" "${OUTER[@]}" "$SYSTEM_PYTHON" "$server_dir/desktop_server.py" --socket "$SOCK" \
    "${listen_fd[@]}" --home "$seen_home" --python "$PYTHON" \
    > "$RUN_DIR/server.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/server.pid"
  wait_for server 20 eval 'answers || ! alive "$(pid_of server)"'
  alive "$(pid_of server)" && answers ||
    fail "the desktop server did not answer on $SOCK within 20 s" "$RUN_DIR/server.log"

  if [ -n "$OWNER_PID" ]; then
    setsid bash "$REPO/launch/desktop.sh" watch --display "$DISPLAY_NUM" \
      --run-dir "$RUN_DIR" --owner-pid "$OWNER_PID" --owner-start "$OWNER_START" \
      > "$RUN_DIR/watch.log" 2>&1 < /dev/null &
    echo $! > "$RUN_DIR/watch.pid"
  fi
  echo "desktop $DISPLAY up: unix socket $SOCK, home $HOME_DIR, logs in $RUN_DIR"
}

check_run_dir
case "$ACTION" in
  start) start_desktop ;;
  stop) stop_desktop ;;
  watch)
    [ -n "$OWNER_PID" ] && [ -n "$OWNER_START" ] || usage
    watch_owner ;;
  status)
    if answers && alive "$(pid_of server)"; then
      echo "desktop :$DISPLAY_NUM running: unix socket $SOCK (run dir $RUN_DIR)"
    else
      echo "desktop :$DISPLAY_NUM not running (run dir $RUN_DIR)"
      exit 3
    fi ;;
  *) usage ;;
esac
