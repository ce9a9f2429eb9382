"""The local desktop (launch/desktop.sh + desktop_server.py) end to end.

One real desktop (Xvfb, openbox, D-Bus, AT-SPI, the server) for the module;
GUI steps go through the same client calls an OSWorld episode makes.
"""

import io
import os
import shutil
import socket
import subprocess
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


@pytest.fixture(scope='module')
def desk(tmp_path_factory):
  base = tmp_path_factory.mktemp('desktop')
  display, port = desktop.free_display_and_port()
  d = desktop.LocalDesktop(display, port, size=SIZE, home=str(base / 'home'),
                           run_dir=str(base / 'run'))
  d.start()
  yield d
  d.stop()


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
  assert result == {'status': 'success', 'output': desk.home + '\n',
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


def _non_loopback_ipv4():
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
      s.connect(('192.0.2.1', 9))  # no packet is sent
      address = s.getsockname()[0]
    if not address.startswith('127.') and address != '0.0.0.0':
      return address
  except OSError:
    pass
  try:
    infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
  except OSError:
    return None
  return next((i[4][0] for i in infos if not i[4][0].startswith('127.')),
              None)


def test_reachable_on_loopback_only(desk):
  with socket.create_connection(('127.0.0.1', desk.port), timeout=2):
    pass
  address = _non_loopback_ipv4()
  if address is None:
    pytest.skip('this machine has no non-loopback IPv4 address')
  with pytest.raises(OSError):
    socket.create_connection((address, desk.port), timeout=2).close()


def test_server_refuses_a_public_host(tmp_path):
  done = subprocess.run(
      ['/usr/bin/python3', SERVER, '--host', '0.0.0.0', '--port', '1',
       '--home', str(tmp_path / 'home')], capture_output=True, text=True,
      timeout=30, check=False)
  assert done.returncode != 0
  assert 'refusing --host 0.0.0.0' in done.stderr


def test_errors_raise_desktop_error(client, desk):
  with pytest.raises(desktop.DesktopError, match='HTTP 404'):
    client._request('/no/such/endpoint')  # pylint: disable=protected-access
  with pytest.raises(desktop.DesktopError, match='HTTP 400'):
    client.execute([])
  taken = desktop.LocalDesktop(desk.display, desk.port + 1, home=desk.home,
                               run_dir=desk.run_dir + '_other')
  with pytest.raises(desktop.DesktopError, match='in use'):
    taken.start()
  assert desk.alive()


def test_stop_and_start_again(desk):
  desk.stop()
  assert not desk.alive()
  with pytest.raises(desktop.DesktopError, match=str(desk.port)):
    desk.client.platform()
  desk.stop()  # idempotent
  desk.start()
  assert desk.alive()
  assert desk.client.screen_size() == SIZE
