"""The local desktop (launch/desktop.sh + desktop_server.py) end to end.

One real desktop (Xvfb, openbox, D-Bus, AT-SPI, the server) for the module;
GUI steps go through the same client calls an OSWorld episode makes.
"""

import http.server
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import xml.etree.ElementTree as ET

from PIL import Image
import pytest

from rla_jax.envs.osworld import desktop

if shutil.which('Xvfb') is None:
  pytest.skip('Xvfb is not installed (apt-get install xvfb openbox dbus-x11 '
              'at-spi2-core python3-pyatspi; .ci/run does)',
              allow_module_level=True)

SIZE = (1024, 768)
ST = '{https://accessibility.ubuntu.example.org/ns/state}'
CP = '{https://accessibility.ubuntu.example.org/ns/component}'
SERVER = os.path.join(os.path.dirname(desktop.__file__), 'desktop_server.py')
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
NOBODY = ['setpriv', '--reuid=65534', '--regid=65534', '--clear-groups']


def private_tmp_dir():
  """A 0700 folder right in /tmp: only its own mode keeps others out."""
  return tempfile.mkdtemp(prefix='rla_dt_', dir='/tmp')


@pytest.fixture(scope='module')
def desk(tmp_path_factory):
  base = tmp_path_factory.mktemp('desktop')
  run_dir = private_tmp_dir()
  d = desktop.LocalDesktop(desktop.free_display(), size=SIZE,
                           home=str(base / 'home'), run_dir=run_dir)
  d.start()
  yield d
  d.stop()
  shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def client(desk):
  desk.client.reset()
  return desk.client


def wait_for(condition, what, timeout=10.0):
  deadline = time.monotonic() + timeout
  while True:
    value = condition()  # an Element without children is falsy
    if value is not None and value is not False:
      return value
    if time.monotonic() > deadline:
      raise AssertionError(f'no {what} after {timeout} s')
    time.sleep(0.1)


def dialog(client, title):
  """The a11y element of the dialog titled `title`, or None."""
  tree = ET.fromstring(client.accessibility())
  return next((e for e in tree.iter('dialog') if e.get('name') == title),
              None)


def center(element):
  x, y = eval(element.get(CP + 'screencoord'))  # pylint: disable=eval-used
  w, h = eval(element.get(CP + 'size'))  # pylint: disable=eval-used
  return x + w // 2, y + h // 2


def test_screenshot_platform_and_size(client):
  image = Image.open(io.BytesIO(client.screenshot()))
  assert image.format == 'PNG'
  assert image.size == SIZE
  assert client.screen_size() == SIZE
  assert client.platform() == 'Linux'


def test_typed_text_shows_in_accessibility_tree(client):
  client.launch(['zenity', '--entry', '--title=RlaType', '--text=Name:'])
  box = wait_for(lambda: dialog(client, 'RlaType'), 'zenity dialog')
  entry = next(e for e in box.iter('text') if e.get(ST + 'editable'))
  x, y = center(entry)
  result = client.run_pyautogui(
      f"pyautogui.click({x}, {y}); "
      "pyautogui.write('hello osworld', interval=0.01)")
  assert result['returncode'] == 0, result
  assert result['status'] == 'success'
  entry = wait_for(
      lambda: next((e for e in dialog(client, 'RlaType').iter('text')
                    if e.text == 'hello osworld'), None), 'typed text')
  assert entry.get(ST + 'focused') == 'true'


def test_execute_and_file(client, desk):
  result = client.execute("printf 'abc' > ~/out.txt && echo $HOME",
                          shell=True)
  # The jail shows the desktop's home at OSWorld's path.
  assert result == {'status': 'success', 'output': '/home/user\n',
                    'error': '', 'returncode': 0}
  assert client.file('~/out.txt') == b'abc'
  assert client.file(os.path.join(desk.home, 'out.txt')) == b'abc'
  assert client.file('~/missing.txt') is None
  # `python` is the venv's, with pyautogui.
  assert client.execute(['python', '-c', 'import pyautogui'])['returncode'] == 0
  failed = client.execute(['sh', '-c', 'echo oops >&2; exit 3'])
  assert (failed['status'], failed['error'], failed['returncode']) == (
      'success', 'oops\n', 3)
  slow = client.execute(['sleep', '5'], timeout=0.3)
  assert slow['status'] == 'error' and 'timed out' in slow['error']
  missing = client.execute(['no-such-program-rla'])
  assert missing['status'] == 'error'


def test_reset_kills_apps_and_empties_home(client, desk):
  client.launch(['zenity', '--info', '--title=RlaReset', '--text=bye'])
  client.launch('sleep 300 & xterm -T RlaXterm', shell=True)
  client.execute(['mkdir', '-p', '~/a/b'])
  client.execute('touch ~/a/b/f ~/.hidden && chmod a-w ~/a/b', shell=True)
  # A window of a client the server did not start: reset disconnects it.
  outside = subprocess.Popen(
      ['xterm', '-T', 'RlaOutside'], stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
      env=dict(os.environ, DISPLAY=f':{desk.display}',
               XAUTHORITY=os.path.join(desk.run_dir, 'Xauthority')))
  wait_for(lambda: dialog(client, 'RlaReset'), 'zenity dialog')
  for title in ('RlaXterm', 'RlaOutside'):
    wait_for(lambda: title in client.execute(['wmctrl', '-l'])['output'],
             f'{title} window')
  started = time.monotonic()
  client.reset()
  assert time.monotonic() - started < 2.0
  assert dialog(client, 'RlaReset') is None
  assert client.execute(['wmctrl', '-l'])['output'] == ''
  assert outside.wait(timeout=5) is not None
  # ([s]: not the sandbox's command line, which holds the pattern itself.)
  assert client.execute(['pgrep', '-f', '[s]leep 300'])['returncode'] == 1
  assert os.listdir(desk.home) == []


def listening_tcp_ports(pid):
  """TCP ports (IPv4 and IPv6) that process pid listens on."""
  inodes = set()
  for fd in os.listdir(f'/proc/{pid}/fd'):
    try:
      link = os.readlink(f'/proc/{pid}/fd/{fd}')
    except OSError:
      continue
    if link.startswith('socket:['):
      inodes.add(link[8:-1])
  ports = []
  for table in ('/proc/net/tcp', '/proc/net/tcp6'):
    with open(table) as f:
      for line in f.readlines()[1:]:
        fields = line.split()
        if fields[3] == '0A' and fields[9] in inodes:  # 0A: LISTEN
          ports.append(int(fields[1].rsplit(':', 1)[1], 16))
  return ports


def desktop_pids(run_dir):
  """Pids of every process of the desktop of run_dir: its pid files' and
  those carrying its RLA_DESKTOP_RUN tag."""
  pids = set()
  for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
    if name.endswith('.pid'):
      with open(os.path.join(run_dir, name)) as f:
        text = f.read().strip()
      if text.isdigit():
        pids.add(int(text))
  tag = f'RLA_DESKTOP_RUN={run_dir}'.encode()
  for entry in os.listdir('/proc'):
    try:
      with open(f'/proc/{entry}/environ', 'rb') as f:
        if tag in f.read().split(b'\0'):
          pids.add(int(entry))
    except (OSError, ValueError):
      continue
  return pids


def live(pids):
  """The pids still running (a zombie is not)."""
  left = set()
  for pid in pids:
    try:
      with open(f'/proc/{pid}/stat') as f:
        state = f.read().rsplit(')', 1)[1].split()[0]
    except OSError:
      continue
    if state not in 'ZX':
      left.add(pid)
  return left


def processes_running(text):
  """Pids whose command line contains text."""
  found = set()
  for entry in os.listdir('/proc'):
    try:
      with open(f'/proc/{entry}/cmdline', 'rb') as f:
        if text.encode() in f.read():
          found.add(int(entry))
    except OSError:
      continue
  return found - {os.getpid()}


def wait_until_gone(pids, timeout):
  deadline = time.monotonic() + timeout
  while live(pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  return live(pids)


def test_not_reachable_over_tcp(desk):
  with open(os.path.join(desk.run_dir, 'server.pid')) as f:
    server = int(f.read())
  assert listening_tcp_ports(server) == []
  assert desktop.connect_unix(desk.socket_path, 2).close() is None
  assert stat_mode(desk.run_dir) == 0o700
  assert stat_mode(desk.socket_path) == 0o600


def stat_mode(path):
  return os.stat(path).st_mode & 0o7777


NOBODY_TRIES = textwrap.dedent(r'''
    import os, socket, sys
    path = sys.argv[1]
    def attempt(what, fn):
      try:
        fn()
        print(what, 'ok')
      except OSError as e:
        print(what, type(e).__name__)
    def execute():
      s = socket.socket(socket.AF_UNIX)
      s.settimeout(5)
      s.connect(path)
      body = b'{"command": ["touch", "/tmp/rla_nobody_was_here"]}'
      s.sendall(b'POST /execute HTTP/1.0\r\nContent-Type: application/json'
                b'\r\nContent-Length: %d\r\n\r\n%s' % (len(body), body))
      s.recv(100)
    def screen():
      s = socket.socket(socket.AF_UNIX)
      s.connect(path)
      s.sendall(b'GET /screenshot HTTP/1.0\r\n\r\n')
      s.recv(100)
    def impostor():
      socket.socket(socket.AF_UNIX).bind(
          os.path.join(os.path.dirname(path), 'impostor.sock'))
    attempt('execute', execute)
    attempt('screenshot', screen)
    attempt('bind', impostor)
    for port in map(int, sys.argv[2:]):
      attempt(f'tcp {port}', lambda: socket.create_connection(
          ('127.0.0.1', port), timeout=2).close())
    ''')


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which('setpriv'),
                    reason='needs root and setpriv to run as another uid')
def test_another_uid_cannot_reach_the_desktop(desk):
  """Nobody (uid 65534) can neither run commands nor see the screen, nor
  plant a socket where our client would find it."""
  with open(os.path.join(desk.run_dir, 'server.pid')) as f:
    ports = listening_tcp_ports(int(f.read()))
  done = subprocess.run(
      NOBODY + ['/usr/bin/python3', '-c', NOBODY_TRIES, desk.socket_path] +
      [str(p) for p in ports], capture_output=True, text=True, timeout=60,
      check=False)
  assert done.returncode == 0, done.stderr
  assert done.stdout.split('\n')[:3] == [
      'execute PermissionError', 'screenshot PermissionError',
      'bind PermissionError'], done.stdout
  assert ' ok' not in done.stdout
  assert not os.path.exists('/tmp/rla_nobody_was_here')
  assert desk.alive()


class _Impostor:
  """An HTTP server on a unix socket at path that answers everything 200,
  as an impostor forging a passed evaluation would; counts connections."""

  def __init__(self, path):
    self.connections = 0
    outer = self

    class Answer(http.server.BaseHTTPRequestHandler):
      def do_GET(self):  # pylint: disable=invalid-name
        outer.connections += 1
        self.send_response(200)
        self.send_header('Content-Length', '5')
        self.end_headers()
        self.wfile.write(b'Linux')
      do_POST = do_GET  # pylint: disable=invalid-name

      def address_string(self):
        return 'unix'

      def log_message(self, *args):
        pass

    import socketserver  # pylint: disable=g-import-not-at-top
    self.server = socketserver.UnixStreamServer(path, Answer)
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def close(self):
    self.server.shutdown()
    self.server.server_close()


@pytest.mark.parametrize('how', ['open to others', 'group writable',
                                 'another uid'])
def test_client_refuses_a_socket_another_uid_could_have_made(how):
  run_dir = private_tmp_dir()
  try:
    path = os.path.join(run_dir, 'server.sock')
    impostor = _Impostor(path)
    try:
      if how == 'open to others':
        os.chmod(run_dir, 0o777)
        why = 'open to others'
      elif how == 'group writable':
        os.chmod(run_dir, 0o770)
        why = 'open to others'
      else:
        if os.geteuid() != 0:
          pytest.skip('needs root to chown a folder to another uid')
        os.chown(run_dir, 65534, 65534)
        why = 'belongs to uid 65534'
      client = desktop.Client(path, timeout=5)
      with pytest.raises(desktop.DesktopError, match=why) as e:
        client.platform()
      assert path in str(e.value) and '/platform' in str(e.value)
      with pytest.raises(desktop.DesktopError, match=why):
        client.execute(['true'])
      made = desktop.LocalDesktop(1, home=os.path.join(run_dir, 'h'),
                                  run_dir=run_dir)
      assert not made.alive()
      router = desktop.unix_requests()
      router.add(client)
      with pytest.raises(desktop.DesktopError, match=why):
        router.get(client.url + '/platform', timeout=5)
      assert impostor.connections == 0
      os.chmod(run_dir, 0o700)
      if how != 'another uid':  # the same socket is trusted once private
        assert client.platform() == 'Linux'
        assert impostor.connections == 1
    finally:
      impostor.close()
  finally:
    shutil.rmtree(run_dir, ignore_errors=True)


def test_desktop_sh_refuses_a_run_dir_others_can_reach(tmp_path):
  run_dir = private_tmp_dir()
  try:
    os.chmod(run_dir, 0o755)
    made = desktop.LocalDesktop(desktop.free_display(), home=str(
        tmp_path / 'home'), run_dir=run_dir)
    with pytest.raises(desktop.DesktopError, match='refusing run dir'):
      made.start()
    assert os.listdir(run_dir) == []
  finally:
    shutil.rmtree(run_dir, ignore_errors=True)


def test_server_refuses_tcp_and_a_socket_others_can_reach(tmp_path):
  home = str(tmp_path / 'home')
  private = private_tmp_dir()
  try:
    done = subprocess.run(
        ['/usr/bin/python3', SERVER, '--socket', private + '/s.sock',
         '--host', '0.0.0.0', '--port', '1', '--home', home],
        capture_output=True, text=True, timeout=30, check=False)
  finally:
    shutil.rmtree(private)
  assert done.returncode != 0
  assert 'unrecognized arguments: --host 0.0.0.0 --port 1' in done.stderr
  shared = tmp_path / 'shared'
  shared.mkdir(mode=0o777)
  os.chmod(shared, 0o777)
  done = subprocess.run(
      ['/usr/bin/python3', SERVER, '--socket', str(shared / 's.sock'),
       '--home', home], capture_output=True, text=True, timeout=30,
      check=False)
  assert done.returncode != 0
  assert 'refusing --socket' in done.stderr and 'open to group' in done.stderr
  assert not (shared / 's.sock').exists()


TRAINER = textwrap.dedent('''
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from rla_jax.envs.osworld import desktop
    d = desktop.LocalDesktop(desktop.free_display(120), size=(640, 480),
                             home=sys.argv[2] + '/home', run_dir=sys.argv[3])
    d.start()
    print('up', flush=True)
    time.sleep(600)
    ''')


def test_a_killed_trainer_takes_its_desktop_down(tmp_path):
  run_dir = private_tmp_dir()
  trainer = subprocess.Popen(
      [sys.executable, '-c', TRAINER, ROOT, str(tmp_path), run_dir],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    assert trainer.stdout.readline() == 'up\n', trainer.stderr.read()
    pids = desktop_pids(run_dir)
    assert len(live(pids)) >= 6, pids  # the watcher, server and 4 daemons
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    assert wait_until_gone(pids, 10) == set()
    assert live(desktop_pids(run_dir)) == set()
    assert not os.path.exists(os.path.join(run_dir, 'server.sock'))
  finally:
    if trainer.poll() is None:
      trainer.kill()
    subprocess.run(['bash', os.path.join(ROOT, 'launch', 'desktop.sh'),
                    'stop', '--run-dir', run_dir], check=False,
                   capture_output=True)
    shutil.rmtree(run_dir, ignore_errors=True)


def test_errors_raise_desktop_error(client, desk):
  with pytest.raises(desktop.DesktopError, match='HTTP 404'):
    client._request('/no/such/endpoint')  # pylint: disable=protected-access
  with pytest.raises(desktop.DesktopError, match='HTTP 400'):
    client.execute([])
  taken = desktop.LocalDesktop(desk.display, home=desk.home,
                               run_dir=desk.run_dir + '_other')
  with pytest.raises(desktop.DesktopError, match='in use'):
    taken.start()
  assert desk.alive()


def test_stop_and_start_again(desk):
  desk.client.launch(['sleep', '3141.59'])
  desk.client.launch('sleep 2718.28 &', shell=True)
  pids = desktop_pids(desk.run_dir)
  assert len(live(pids)) >= 6, pids  # the watcher, server and 4 daemons
  wait_for(lambda: len(processes_running('2718.28')) >= 1, 'sleep 2718.28')
  desk.stop()
  assert live(pids) == set()
  assert live(desktop_pids(desk.run_dir)) == set()
  assert processes_running('3141.59') == set()
  assert processes_running('2718.28') == set()
  assert not desk.alive()
  with pytest.raises(desktop.DesktopError, match='server.sock'):
    desk.client.platform()
  desk.stop()  # idempotent
  desk.start()
  assert desk.alive()
  assert desk.client.screen_size() == SIZE
