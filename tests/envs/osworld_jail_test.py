"""The local desktop's jail (desktop_jail.py), attacked the way a policy would.

Each test is a finding of the red team on the old jail (the host read-only
but the run dir writable, the trainer's environment passed on, the network
shared, apps found by an environment tag): the D-Bus service-file escape
through the agent's own actions, capabilities of a root trainer, the
training user's files and secrets, the network, and detached survivors of
a reset or a stop.
"""

import os
import pwd
import shutil
import subprocess
import time
import uuid

import pytest

from rla_jax.envs.osworld import desktop
from rla_jax.envs.osworld import environment as osworld
from rla_jax.envs.osworld import prompts

pytestmark = pytest.mark.skipif(
    not all(shutil.which(b) for b in ('Xvfb', 'openbox', 'xterm', 'bwrap',
                                      'dbus-send')),
    reason='the local desktop needs Xvfb, openbox, xterm, bwrap and dbus '
           '(.ci/run installs them)')

SECRET = f'rla-secret-{uuid.uuid4().hex}'


@pytest.fixture(scope='module')
def desk(tmp_path_factory):
  base = tmp_path_factory.mktemp('jail')
  os.environ['RLA_JAIL_TEST_TOKEN'] = SECRET  # the trainer's environment
  try:
    made = desktop.LocalDesktop(desktop.free_display(300), size=(800, 600),
                                home=str(base / 'home'),
                                run_dir=str(base / 'run'))
    made.start()
  finally:
    del os.environ['RLA_JAIL_TEST_TOKEN']
  yield made
  made.stop()


@pytest.fixture
def client(desk):
  desk.client.reset()
  return desk.client


def shell(client, command):
  result = client.execute(command, shell=True)
  return result['output'] + result['error']


def _alive(marker):
  """Pids of host processes whose command line holds `marker`."""
  found = []
  for entry in os.listdir('/proc'):
    if entry.isdigit():
      try:
        with open(f'/proc/{entry}/cmdline', 'rb') as f:
          if marker.encode() in f.read():
            found.append(int(entry))
      except OSError:
        continue
  return found


def test_the_dbus_service_file_escape_through_the_agents_actions(desk,
                                                                 client):
  """A .service file written from an xterm the agent types into, then a
  bus reload and activation, must not run anything outside the jail."""
  marker = f'/tmp/rla_escaped_{uuid.uuid4().hex}'
  services = [os.path.join(desk.run_dir, 'runtime', 'dbus-1', 'services'),
              '$XDG_RUNTIME_DIR/dbus-1/services',
              '$HOME/.local/share/dbus-1/services']
  lines = [f'for d in {" ".join(services)}; do mkdir -p $d; printf '
           f'"[D-BUS Service]\\nName=org.rla.Escape\\nExec=/usr/bin/touch '
           f'{marker}\\n" > $d/org.rla.Escape.service; done',
           'dbus-send --session --print-reply --dest=org.freedesktop.DBus '
           '/org/freedesktop/DBus org.freedesktop.DBus.ReloadConfig',
           'dbus-send --session --print-reply --dest=org.freedesktop.DBus '
           '/org/freedesktop/DBus org.freedesktop.DBus.StartServiceByName '
           'string:org.rla.Escape uint32:0',
           'echo done > ~/attack_done']
  client.launch(['xterm', '-geometry', '100x30+0+0'])
  deadline = time.monotonic() + 20
  while 'xterm' not in (client.execute(['wmctrl', '-l']).get('output') or
                        '').lower():
    assert time.monotonic() < deadline, 'no xterm window'
    time.sleep(0.2)
  time.sleep(0.5)
  width, height = client.screen_size()
  for args in ({'action': 'left_click', 'coordinate': [100, 100]},
               *({'action': 'type', 'text': line + '\n'} for line in lines)):
    action = prompts.canonical('scripted', args)
    code = prompts.pyautogui_code(prompts.arguments(action), width, height)
    assert client.run_pyautogui(code)['returncode'] == 0
  deadline = time.monotonic() + 20
  while client.file('attack_done') is None:  # the typing ran in the jail
    assert time.monotonic() < deadline, 'the typed commands never ran'
    time.sleep(0.2)
  time.sleep(1.0)
  assert not os.path.exists(marker)
  # The run dir (the bus's own service folder) is not in the jail.
  assert not os.path.exists(os.path.join(services[0],
                                         'org.rla.Escape.service'))


def test_a_root_trainers_jail_holds_no_capability(client):
  status = shell(client, 'grep ^Cap /proc/self/status; id -u')
  for line in status.strip().splitlines()[:-1]:
    assert line.split()[1] == '0000000000000000', status
  assert status.strip().splitlines()[-1] != '0'  # not root, even in its ns
  out = shell(client, 'mount -o remount,bind,rw / 2>&1; echo x > /etc/rla '
                      '2>&1; ls /etc/rla 2>&1')
  assert 'No such file' in out
  assert not os.path.exists('/etc/rla')


def _desk_uid(run_dir):
  """The host uid a root-started desktop runs as (desktop.sh records it)."""
  with open(os.path.join(run_dir, 'uid')) as f:
    return int(f.read())


def _uid_processes(uid):
  """{pid: command line} of the live processes of host uid `uid`."""
  found = {}
  for entry in os.listdir('/proc'):
    if entry.isdigit():
      try:
        with open(f'/proc/{entry}/status') as f:
          fields = dict(l.split(':', 1) for l in f if ':' in l)
        if (int(fields['Uid'].split()[0]) == uid
            and fields['State'].split()[0] != 'Z'):
          with open(f'/proc/{entry}/cmdline', 'rb') as f:
            found[int(entry)] = f.read().replace(b'\0', b' ').decode()
      except (OSError, KeyError, ValueError):
        continue
  return found


root_only = pytest.mark.skipif(os.geteuid() != 0,
                               reason='what a root trainer\'s desktop does')


@root_only
def test_a_root_trainers_desktop_runs_as_an_unprivileged_uid(desk, client):
  """Not root on the host, nor root's files: a uid of its own, for the
  apps, a survivor of theirs and the desktop's own processes."""
  uid = _desk_uid(desk.run_dir)
  assert uid >= 1_000_000_000
  marker = str(6_000_000 + os.getpid() % 1_000_000)
  shell(client, f'touch ~/mine; setsid sleep {marker} > /dev/null 2>&1 &')
  assert os.stat(os.path.join(desk.home, 'mine')).st_uid == uid
  deadline = time.monotonic() + 10
  while not _alive(f'sleep\0{marker}'):
    assert time.monotonic() < deadline, 'the survivor never started'
    time.sleep(0.1)
  processes = _uid_processes(uid)
  assert set(_alive(f'sleep\0{marker}')) <= set(processes)
  desktop_processes = ' | '.join(processes.values())
  for program in ('desktop_server.py', 'Xvfb', 'dbus-daemon', 'openbox'):
    assert program in desktop_processes
  # Root keeps the run dir: its pid files, logs and socket.
  st = os.stat(desk.run_dir)
  assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700)
  assert os.stat(desk.client.socket_path).st_uid == 0
  client.reset()
  assert not _alive(f'sleep\0{marker}')


@root_only
def test_a_root_trainers_desktop_writes_only_its_state_and_the_home(desk):
  """The desktop's own processes (not only the apps' jails) see the host
  read-only but for a private /tmp, the X socket dir, its state dir and
  the home; nothing of root's (/root, the run dir) is in their view."""
  uid = _desk_uid(desk.run_dir)
  server = next(p for p, line in _uid_processes(uid).items()
                if 'desktop_server.py' in line)
  writable = set()
  with open(f'/proc/{server}/mountinfo') as f:
    for line in f:
      fields = line.split()
      if 'rw' in fields[5].split(','):
        writable.add(fields[4])
  writable = {w for w in writable if not w.startswith(('/dev', '/proc'))}
  assert writable == {'/', '/tmp', '/tmp/.X11-unix', '/run/rla/desk',
                      '/run/rla/home'}, writable
  root = f'/proc/{server}/root'
  for made in ('', '/run', '/run/rla'):  # bwrap's folders: root's, 0755
    st = os.stat(root + made + '/')
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o755), made
  assert not os.path.exists(root + desk.run_dir)
  planted = os.path.join(os.path.expanduser('~'),
                         f'.rla_jail_test_{uuid.uuid4().hex}')
  with open(planted, 'w') as f:
    f.write(SECRET)
  try:
    assert os.path.exists(planted)
    assert not os.path.exists(root + planted)
  finally:
    os.unlink(planted)


@root_only
def test_a_root_trainers_desktop_leaves_no_process_of_its_uid(tmp_path):
  made = desktop.LocalDesktop(desktop.free_display(330), size=(640, 400),
                              home=str(tmp_path / 'home'),
                              run_dir=str(tmp_path / 'run'))
  made.start()
  try:
    uid = _desk_uid(made.run_dir)
    made.client.launch('setsid env -i sleep 4242 & exec sleep 999',
                       shell=True)
    assert _uid_processes(uid)
  finally:
    made.stop()
  assert _uid_processes(uid) == {}
  assert os.listdir(made.run_dir)  # root's logs stay; the uid's state not
  assert not os.path.exists(os.path.join(made.run_dir, 'desk'))


@root_only
@pytest.mark.parametrize('home', ['/srv', '{repo}', '{root}', '{repo}/..'])
def test_a_root_trainers_desktop_refuses_a_home_it_would_hand_over(home,
                                                                   tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  home = home.format(repo=repo, root=os.path.expanduser('~root'))
  made = desktop.LocalDesktop(desktop.free_display(340), size=(640, 400),
                              home=home, run_dir=str(tmp_path / 'run'))
  with pytest.raises(desktop.DesktopError, match='refusing --home'):
    made.start()
  assert os.stat(repo).st_uid == 0


def test_a_planted_symlink_is_refused_as_run_dir_or_home(tmp_path):
  """Another user may plant /tmp/rla_desktop_<N> or a home as a symlink to
  a folder of ours: we would write there (and a root desktop chown it)."""
  target = tmp_path / 'ours'
  target.mkdir(mode=0o700)
  (tmp_path / 'run_link').symlink_to(target)
  with pytest.raises(desktop.DesktopError, match='symlink'):
    desktop.LocalDesktop(1, home=str(tmp_path / 'h'),
                         run_dir=str(tmp_path / 'run_link'))
  (tmp_path / 'home_link').symlink_to(target)
  for args in (['--run-dir', str(tmp_path / 'run_link')],
               ['--run-dir', str(tmp_path / 'run'),
                '--home', str(tmp_path / 'home_link')]):
    done = subprocess.run(['bash', str(desktop.SCRIPT), 'start', '--display',
                           '351'] + args, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 2 and 'symlink' in done.stderr, done.stderr
  assert os.listdir(target) == []
  assert not os.path.exists(tmp_path / 'run')


@root_only
def test_a_root_trainers_desktop_refuses_another_users_home(tmp_path):
  home = tmp_path / 'theirs'
  home.mkdir()
  os.chown(home, 65534, 65534)
  made = desktop.LocalDesktop(desktop.free_display(352), size=(640, 400),
                              home=str(home), run_dir=str(tmp_path / 'run'))
  with pytest.raises(desktop.DesktopError, match='belongs to uid 65534'):
    made.start()
  assert os.stat(home).st_uid == 65534


def test_the_training_users_files_and_secrets_are_not_in_the_jail(desk,
                                                                  client):
  real_home = pwd.getpwuid(os.getuid()).pw_dir
  planted = os.path.join(real_home, f'.rla_jail_test_{uuid.uuid4().hex}')
  with open(planted, 'w') as f:
    f.write(SECRET)
  repo = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  try:
    for path in (planted, os.path.join(repo, 'README.md'), desk.run_dir,
                 os.path.join(desk.run_dir, 'Xauthority'), '/proc/1/environ'):
      out = shell(client, f'cat {path} 2>&1 | head -c 300; ls {path} 2>&1')
      assert SECRET not in out and 'MIT-MAGIC' not in out, (path, out)
    assert 'No such file' in shell(client, f'ls {planted}')
    assert 'No such file' in shell(client, f'ls {repo}/README.md')
    environment = shell(client, 'env; cat /proc/self/environ')
    assert SECRET not in environment
    assert 'RLA_JAIL_TEST_TOKEN' not in environment
    assert 'home/user' in shell(client, 'echo $HOME; pwd')
  finally:
    os.remove(planted)


def test_no_network_unless_the_task_asks(client):
  assert shell(client, 'cat /proc/net/dev | tail -n +3 | cut -d: -f1'
               ).split() == ['lo']
  client.reset(network=True)
  shared = shell(client, 'cat /proc/net/dev | tail -n +3 | cut -d: -f1')
  with open('/proc/net/dev') as f:
    host = [line.split(':')[0].strip() for line in f.readlines()[2:]]
  assert shared.split() == host
  client.reset()
  assert shell(client, 'cat /proc/net/dev | tail -n +3 | cut -d: -f1'
               ).split() == ['lo']


def test_a_detached_survivor_is_gone_after_a_reset(client):
  marker = str(7_000_000 + os.getpid() % 1_000_000)
  client.launch(f'setsid env -i sleep {marker} & exec sleep 999', shell=True)
  deadline = time.monotonic() + 10
  while not _alive(f'sleep\0{marker}'):
    assert time.monotonic() < deadline, 'the survivor never started'
    time.sleep(0.1)
  client.reset()
  assert not _alive(f'sleep\0{marker}')


def test_a_detached_survivor_is_gone_after_a_stop(tmp_path):
  made = desktop.LocalDesktop(desktop.free_display(320), size=(640, 400),
                              home=str(tmp_path / 'home'),
                              run_dir=str(tmp_path / 'run'))
  made.start()
  marker = str(8_000_000 + os.getpid() % 1_000_000)
  try:
    made.client.launch(f'setsid env -i sleep {marker} & exec sleep 999',
                       shell=True)
    deadline = time.monotonic() + 10
    while not _alive(f'sleep\0{marker}'):
      assert time.monotonic() < deadline, 'the survivor never started'
      time.sleep(0.1)
  finally:
    made.stop()
  assert not _alive(f'sleep\0{marker}')


def test_bundled_tasks_ask_for_no_network():
  for spec in osworld.load_tasks(osworld.TASK_DIR):
    assert spec.get('network', False) is False, spec['id']


AS_USER = '''
import os, sys, time
sys.path.insert(0, sys.argv[1])
from rla_jax.envs.osworld import desktop
made = desktop.LocalDesktop(desktop.free_display(420), size=(640, 400),
                            home=os.path.expanduser('~/rla_jail_home'),
                            python='/usr/bin/python3')
made.start()
try:
    c = made.client
    print(c.execute('id -u; grep CapEff /proc/self/status; echo $HOME; '
                    'ls /home; tail -n +3 /proc/net/dev | cut -d: -f1',
                    shell=True)['output'])
    c.launch('setsid env -i sleep 6161 & exec sleep 99', shell=True)
    time.sleep(1)
    c.reset()
finally:
    made.stop()
'''


def _readable_by_others(path):
  """Whether every folder down to `path` lets other users through."""
  while path != '/':
    if not os.stat(path).st_mode & 0o001:
      return False
    path = os.path.dirname(path)
  return True


@pytest.mark.slow
def test_the_jail_of_an_unprivileged_trainer():
  """The same jail when the trainer is an ordinary user (useradd)."""
  repo = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  if os.geteuid() != 0 or not shutil.which('useradd'):
    pytest.skip('needs root to add a user')
  if not _readable_by_others(repo):
    pytest.skip(f'{repo} is not readable by other users')
  user = 'rla-jail-test'
  if subprocess.run(['id', user], capture_output=True,
                    check=False).returncode:
    subprocess.run(['useradd', '-m', user], check=True)
  proc = subprocess.run(
      ['su', user, '-s', '/bin/sh', '-c',
       f'cd ~ && /usr/bin/python3 - {repo}'],
      input=AS_USER, capture_output=True, text=True, timeout=120,
      check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  uid, caps, home, homes, *interfaces = proc.stdout.split('\n')[:5] + [
      line for line in proc.stdout.split('\n')[5:] if line.strip()]
  assert uid == str(pwd.getpwnam(user).pw_uid)
  assert caps.split()[1] == '0000000000000000'
  assert (home, homes) == ('/home/user', 'user')
  assert [i.strip() for i in interfaces] == ['lo']
  assert not _alive('sleep\0006161')


@root_only
def test_a_root_desktop_takes_over_an_x_socket_dir_another_user_made(
    tmp_path):
  """An ordinary user's X server that ran first made /tmp/.X11-unix theirs:
  they could then delete a root desktop's socket there and put their own in
  its place. A missing dir (a machine that never ran X) is made; a symlink
  planted in its place is refused."""
  x11 = '/tmp/.X11-unix'
  setups = ['theirs']
  if not os.listdir(x11 if os.path.isdir(x11) else tmp_path):
    # No X server runs now: the dir may go, or be a planted symlink (once
    # unlinked, the dir is missing for the first desktop below).
    setups.insert(0, 'missing')
    shutil.rmtree(x11, ignore_errors=True)
    (tmp_path / 'elsewhere').mkdir()
    os.symlink(tmp_path / 'elsewhere', x11)
    planted = desktop.LocalDesktop(desktop.free_display(360),
                                   home=str(tmp_path / 'link' / 'home'),
                                   run_dir=str(tmp_path / 'link' / 'run'))
    try:
      with pytest.raises(desktop.DesktopError, match='not a directory root'):
        planted.start()
    finally:
      os.unlink(x11)
  for setup in setups:
    if setup == 'theirs':
      os.makedirs(x11, mode=0o1777, exist_ok=True)
      os.chown(x11, 65534, 65534)
    made = desktop.LocalDesktop(desktop.free_display(360), size=(640, 400),
                                home=str(tmp_path / setup / 'home'),
                                run_dir=str(tmp_path / setup / 'run'))
    made.start()
    try:
      shown = made.client.execute('echo up', shell=True)['output']
      assert shown == 'up\n', setup
    finally:
      made.stop()
    info = os.lstat(x11)
    assert (info.st_uid, info.st_mode & 0o7777) == (0, 0o1777), setup
