"""desktop_server.py's whole OSWorld API, and how it fails safe.

One real local desktop (launch/desktop.sh) for the module. OSWorld's own
`PythonController` (the desktop-env wheel) calls every public method of
it; the `SetupController` endpoints get the JSON that SetupController
posts (it cannot be imported without playwright, pydrive and the rest of
OSWorld's evaluators, so the payloads are built here the way its
_*_setup methods build them). The fail-safe part sends what no well-behaved
client sends: paths out of the home, FIFOs and /dev/zero, bad
Content-Lengths, connections that stall.
"""

import io
import json
import os
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET

from PIL import Image
import pytest

from rla_jax.envs.osworld import desktop

# `requests`, but URLs of the desktop (desk.client.url) go to its unix
# socket: the adapter OSWorld's PythonController is driven through.
requests = desktop.unix_requests()

pytestmark = pytest.mark.skipif(
    not all(shutil.which(b) for b in ('Xvfb', 'openbox', 'bwrap', 'xterm',
                                      'mousepad')),
    reason='the local desktop needs Xvfb, openbox, bwrap, xterm and mousepad '
           '(.ci/run installs them)')
python_controller = pytest.importorskip(
    'desktop_env.controllers.python',
    reason='OSWorld\'s desktop-env wheel (launch/setup.sh installs it)')

SIZE = (1024, 768)
APPS_HOME = '/home/user'  # how OSWorld's task JSONs name the home
FILE_LIMIT = 64 << 20  # desktop_setup.FILE_LIMIT
BODY_LIMIT = 1 << 20  # desktop_setup.BODY_LIMIT
UPLOAD_LIMIT = 64 << 20  # desktop_setup.UPLOAD_LIMIT
QUICK_S = 3.0  # what "answered at once" allows on a loaded CI machine


@pytest.fixture(scope='module')
def desk(tmp_path_factory):
  base = tmp_path_factory.mktemp('desktop')
  d = desktop.LocalDesktop(desktop.free_display(), size=SIZE,
                           home=str(base / 'home'), run_dir=str(base / 'run'))
  d.start()
  requests.add(d.client)
  yield d
  d.stop()


@pytest.fixture
def url(desk):
  desk.client.reset()
  return desk.client.url


@pytest.fixture
def pc(url, desk):
  """OSWorld's PythonController, not waiting between its retries."""
  del url  # reset
  controller = desktop.python_controller(desk)
  assert isinstance(controller, python_controller.PythonController)
  controller.retry_interval = 0
  return controller


@pytest.fixture
def home(url):
  """The home as the apps see it (their HOME: the jail may mount it)."""
  return execute(url, 'printf %s "$HOME"', shell=True)['output']


def setup_post(url, endpoint, payload, timeout=30):
  """A POST as SetupController sends it: a JSON string and its header."""
  return requests.post(url + '/setup/' + endpoint, data=json.dumps(payload),
                       headers={'Content-Type': 'application/json'},
                       timeout=timeout)


def upload(url, path, data):
  """/setup/upload as SetupController's MultipartEncoder form sends it."""
  return requests.post(url + '/setup/upload', timeout=30, files={
      'file_path': (None, path),
      'file_data': (os.path.basename(path), data)})


def get_file(url, path):
  return requests.post(url + '/file', data={'file_path': path}, timeout=10)


def execute(url, command, shell=False):
  return requests.post(url + '/execute', timeout=60, json={
      'command': command, 'shell': shell}).json()


def window_titles(url):
  return [line.split(None, 3)[-1] for line in
          execute(url, ['wmctrl', '-l'])['output'].splitlines()]


def wait_for(condition, what, timeout=10.0):
  deadline = time.monotonic() + timeout
  while not condition():
    if time.monotonic() > deadline:
      raise AssertionError(f'no {what} after {timeout} s')
    time.sleep(0.1)


def connect(desk, timeout=None):
  return desktop.connect_unix(desk.socket_path, timeout)


def raw_request(desk, head, timeout=QUICK_S):
  """The status line the server answers to bytes head (no more sent)."""
  with connect(desk, timeout) as s:
    s.sendall(head)
    answer = b''
    while b'\r\n' not in answer:
      chunk = s.recv(4096)
      if not chunk:
        break
      answer += chunk
  return answer.split(b'\r\n')[0].decode()


def png(color, size=(32, 24)):
  out = io.BytesIO()
  Image.new('RGB', size, color).save(out, 'PNG')
  return out.getvalue()


# -- /file and /setup/upload stay in the home ---------------------------------

def test_file_serves_the_home_by_every_name(url, desk):
  with open(os.path.join(desk.home, 'a.txt'), 'wb') as f:
    f.write(b'abc')
  for name in ('a.txt', '~/a.txt', f'{APPS_HOME}/a.txt',
               os.path.join(desk.home, 'a.txt')):
    answer = get_file(url, name)
    assert (answer.status_code, answer.content) == (200, b'abc'), name
  assert get_file(url, 'missing.txt').status_code == 404
  assert get_file(url, '~').status_code == 400  # a directory


def test_file_refuses_paths_out_of_the_home(url, desk):
  os.symlink('/etc/passwd', os.path.join(desk.home, 'pw'))
  os.symlink('/etc', os.path.join(desk.home, 'etc'))
  os.mkdir(os.path.join(desk.home, 'd'))
  for name in ('/etc/passwd', '../x', '~/../x', 'd/../../x',
               f'{APPS_HOME}/../../etc/passwd', '/proc/self/environ', 'pw',
               '~/pw', f'{APPS_HOME}/pw', 'etc/passwd'):
    answer = get_file(url, name)
    assert answer.status_code == 403, (name, answer.text)
    assert b'root:' not in answer.content


def test_file_refuses_special_files_at_once(url, desk):
  home = desk.home
  os.symlink('/dev/zero', os.path.join(home, 'zero'))
  os.mkfifo(os.path.join(home, 'fifo'))
  with open(os.path.join(home, 'big'), 'wb') as f:
    f.truncate(FILE_LIMIT + 1)  # sparse
  with open(os.path.join(home, 'limit'), 'wb') as f:
    f.truncate(FILE_LIMIT)
  for name, status in (('zero', 403), ('fifo', 403), ('big', 413)):
    started = time.monotonic()
    answer = requests.post(url + '/file', data={'file_path': name},
                           timeout=QUICK_S)
    assert answer.status_code == status, (name, answer.text)
    assert time.monotonic() - started < QUICK_S
  assert len(get_file(url, 'limit').content) == FILE_LIMIT


def test_upload_writes_in_the_home_only(url, desk, tmp_path):
  answer = upload(url, f'{APPS_HOME}/docs/new/a.txt', b'hello')
  assert (answer.status_code, answer.text) == (200, 'File Uploaded: 5 bytes')
  with open(os.path.join(desk.home, 'docs', 'new', 'a.txt'), 'rb') as f:
    assert f.read() == b'hello'
  assert upload(url, '~/docs/new/a.txt', b'hi').status_code == 200  # replaced
  assert get_file(url, 'docs/new/a.txt').content == b'hi'
  outside = tmp_path / 'outside'
  outside.mkdir()
  os.symlink(str(outside), os.path.join(desk.home, 'out'))
  os.mkfifo(os.path.join(desk.home, 'fifo'))
  for name in ('/etc/rla_upload', '../rla_upload', 'out/a.txt',
               'out/sub/a.txt', 'fifo'):
    answer = requests.post(url + '/setup/upload', timeout=QUICK_S, files={
        'file_path': (None, name), 'file_data': ('a', b'x')})
    assert answer.status_code == 403, (name, answer.text)
  assert os.listdir(outside) == []
  assert not os.path.exists('/etc/rla_upload')
  assert upload(url, 'x', b'').status_code == 200  # an empty file is a file
  assert requests.post(url + '/setup/upload', files={
      'file_path': (None, 'y')}, timeout=10).status_code == 400


# -- bodies and connections ---------------------------------------------------

@pytest.mark.parametrize('headers, status', [
    ('Content-Length: -1', 400),
    ('Content-Length: abc', 400),
    ('Content-Length: 1e3', 400),
    ('Content-Length: 99999999999999999999999', 413),
    (f'Content-Length: {BODY_LIMIT + 1}', 413),
    ('Transfer-Encoding: chunked', 400),
])
def test_a_bad_body_length_is_refused_at_once(desk, headers, status):
  head = (f'POST /execute HTTP/1.1\r\nHost: x\r\n'
          f'Content-Type: application/json\r\n{headers}\r\n\r\n').encode()
  assert raw_request(desk, head).split()[1] == str(status)
  assert desk.client.platform() == 'Linux'  # still answering


def test_uploads_may_be_larger_than_json_but_are_capped(desk):
  head = ('POST /setup/upload HTTP/1.1\r\nHost: x\r\n'
          'Content-Type: multipart/form-data; boundary=b\r\n'
          f'Content-Length: {UPLOAD_LIMIT + 1}\r\n\r\n').encode()
  assert raw_request(desk, head).split()[1] == '413'


def test_a_stalled_client_does_not_stop_the_server(url, desk):
  silent = connect(desk)
  half = connect(desk)
  half.sendall(b'POST /execute HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"co')
  partial = connect(desk)
  partial.sendall(b'GET /platf')
  try:
    started = time.monotonic()
    assert requests.get(url + '/platform', timeout=QUICK_S).text == 'Linux'
    assert execute(url, ['echo', 'ok'])['output'] == 'ok\n'
    assert time.monotonic() - started < QUICK_S
  finally:
    for s in (silent, half, partial):
      s.close()


# -- PythonController, every public method ------------------------------------

def test_controller_observes_the_screen(pc):
  shot = pc.get_screenshot()
  assert Image.open(io.BytesIO(shot)).size == SIZE
  assert ET.fromstring(pc.get_accessibility_tree()).tag == 'desktop-frame'
  assert pc.get_terminal_output() is None  # no terminal with accessibility
  assert pc.get_vm_screen_size() == {'width': SIZE[0], 'height': SIZE[1]}
  assert pc.get_vm_platform() == 'Linux'


def test_controller_runs_commands_and_scripts(pc, home):
  assert pc.execute_python_command("print('hi')") == {
      'status': 'success', 'output': 'hi\n', 'error': '', 'returncode': 0}
  ok = pc.run_python_script('import os\nprint(os.environ["HOME"])')
  assert (ok['status'], ok['output'], ok['return_code']) == (
      'success', home + '\n', 0)
  failed = pc.run_python_script('import sys\nsys.exit(3)')
  assert (failed['status'], failed['return_code']) == ('error', 3)
  assert failed['error'] == 'Process exited with code 3'
  raised = pc.run_python_script('raise ValueError("boom")')
  assert raised['status'] == 'error' and 'ValueError: boom' in raised['error']
  pc.execute_python_command("import os; os.makedirs('sub')")
  bash = pc.run_bash_script('pwd\necho err >&2\nexit 4', working_dir='~/sub')
  assert bash == {'status': 'error', 'returncode': 4, 'error': '',
                  'output': home + '/sub\nerr\n'}
  assert pc.run_bash_script('pwd', working_dir=APPS_HOME)[
      'output'] == home + '\n'


def test_script_timeouts_and_bad_input_answer_as_osworld(url):
  answer = requests.post(url + '/run_bash_script', json={
      'script': 'sleep 30', 'timeout': 0.5}, timeout=10)
  assert answer.status_code == 500
  assert answer.json() == {
      'status': 'error', 'returncode': -1, 'error': '',
      'output': 'Script execution timed out after 0.5 seconds'}
  missing = requests.post(url + '/run_bash_script', json={
      'script': 'pwd', 'working_dir': '~/nope'}, timeout=10)
  assert missing.status_code == 400
  assert 'does not exist' in missing.json()['output']
  assert requests.post(url + '/run_python', json={},
                       timeout=10).status_code == 400
  assert requests.post(url + '/run_python', json={'code': 'x' * 200_000},
                       timeout=10).status_code == 413


def test_controller_reads_files_and_folders(pc, home):
  assert pc.get_vm_desktop_path() is None  # OSWorld's 404: no ~/Desktop
  pc.execute_python_command(
      "import os; os.makedirs('Desktop/a'); open('Desktop/a/f', 'w');"
      "open('Desktop/g.txt', 'w').write('G'); os.symlink('/', 'Desktop/root')")
  desktop_dir = pc.get_vm_desktop_path()
  assert desktop_dir == home + '/Desktop'
  assert pc.get_file(f'{APPS_HOME}/Desktop/g.txt') == b'G'
  assert pc.get_file(desktop_dir + '/g.txt') == b'G'
  assert pc.get_file('/etc/hostname') is None  # refused (403)
  tree = {'type': 'directory', 'name': 'Desktop', 'children': [
      {'type': 'directory', 'name': 'a', 'children': [
          {'type': 'file', 'name': 'f'}]},
      {'type': 'file', 'name': 'g.txt'},
      {'type': 'file', 'name': 'root'}]}  # a symlink is not followed
  assert pc.get_vm_directory_tree(f'{APPS_HOME}/Desktop') == tree
  assert pc.get_vm_directory_tree(desktop_dir) == tree
  assert pc.get_vm_directory_tree('/etc') is None  # out of the home


def test_controller_windows_actions_and_cursor(pc, url):
  requests.post(url + '/setup/launch', timeout=10, json={
      'command': ['xterm', '-T', 'RlaSize', '-geometry', '40x10']})
  wait_for(lambda: 'RlaSize' in window_titles(url), 'xterm window')
  size = pc.get_vm_window_size('XTerm')
  assert 100 < size['width'] < SIZE[0] and 50 < size['height'] < SIZE[1]
  assert pc.get_vm_window_size('no-such-class') is None
  pc.execute_action({'action_type': 'MOVE_TO', 'x': 20, 'y': 30})
  assert requests.get(url + '/cursor_position', timeout=10).json() == [20, 30]
  pc.execute_action({'action_type': 'CLICK', 'button': 'left', 'x': 700,
                     'y': 600})
  assert requests.get(url + '/cursor_position', timeout=10).json() == [
      700, 600]
  assert pc.execute_action('DONE') is None


def test_controller_wallpaper(pc, url, desk):
  red = png((220, 20, 30))
  assert upload(url, f'{APPS_HOME}/wall.png', red).status_code == 200
  assert pc.get_vm_wallpaper() is None  # none set yet
  answer = setup_post(url, 'change_wallpaper',
                      {'path': f'{APPS_HOME}/wall.png'})
  assert (answer.status_code, answer.text) == (
      200, 'Wallpaper changed successfully')
  assert pc.get_vm_wallpaper() == red
  screen = Image.open(io.BytesIO(pc.get_screenshot())).convert('RGB')
  assert screen.getpixel((SIZE[0] - 5, SIZE[1] - 5)) == (220, 20, 30)
  assert setup_post(url, 'change_wallpaper', {
      'path': '~/none.png'}).status_code == 404
  with open(os.path.join(desk.home, 'text.png'), 'w') as f:
    f.write('not a picture')
  assert setup_post(url, 'change_wallpaper', {
      'path': 'text.png'}).status_code == 400
  assert setup_post(url, 'change_wallpaper', {
      'path': '/usr/share/pixmaps/debian-logo.png'}).status_code == 403
  desk.client.reset()
  assert pc.get_vm_wallpaper() is None
  screen = Image.open(io.BytesIO(pc.get_screenshot())).convert('RGB')
  assert screen.getpixel((SIZE[0] - 5, SIZE[1] - 5)) != (220, 20, 30)


def test_controller_recording(pc, url, tmp_path):
  dest = tmp_path / 'video.mp4'
  if shutil.which('ffmpeg') is None:
    for endpoint in ('/start_recording', '/end_recording'):
      answer = requests.post(url + endpoint, timeout=10)
      assert answer.status_code == 501
      assert 'ffmpeg' in answer.json()['message']
    pc.start_recording()  # logs the 501, as for any failure
    pc.end_recording(str(dest))
    assert not dest.exists()
    return
  pc.start_recording()
  time.sleep(1.5)
  pc.end_recording(str(dest))
  video = dest.read_bytes()
  assert video[4:8] == b'ftyp'  # an MP4
  probe = subprocess.run(
      ['ffprobe', '-v', 'error', '-show_entries',
       'stream=codec_name,width,height:format=duration', '-of', 'json',
       str(dest)], capture_output=True, text=True, check=True)
  found = json.loads(probe.stdout)
  assert found['streams'] == [{'codec_name': 'h264', 'width': SIZE[0],
                               'height': SIZE[1]}]
  assert float(found['format']['duration']) > 0.5
  assert requests.post(url + '/end_recording', timeout=10).status_code == 400


# -- SetupController's endpoints ---------------------------------------------

def test_setup_probe_execute_and_launch(url, home):
  assert requests.get(url + '/terminal', timeout=10).json() == {
      'output': None, 'status': 'success'}  # SetupController.setup's probe
  result = setup_post(url, 'execute', {'command': ['sh', '-c', 'echo $HOME'],
                                       'shell': False}).json()
  assert (result['output'], result['returncode']) == (home + '\n', 0)
  assert setup_post(url, 'launch', {'command': ['xterm', '-T', 'RlaLaunch'],
                                    'shell': False}).status_code == 200
  wait_for(lambda: 'RlaLaunch' in window_titles(url), 'launched window')


def test_setup_execute_with_verification(url):
  passed = setup_post(url, 'execute_with_verification', {
      'command': 'xterm -T RlaVerify &', 'shell': True,
      'verification': {'window_exists': 'rlaverify',
                       'command_success': 'test -d ~'},
      'max_wait_time': 10, 'check_interval': 0.1})
  assert passed.status_code == 200, passed.text
  assert (passed.json()['status'], passed.json()['verification']) == (
      'success', 'passed')
  failed = setup_post(url, 'execute_with_verification', {
      'command': ['true'], 'shell': False,
      'verification': {'command_success': 'false'},
      'max_wait_time': 0.3, 'check_interval': 0.1})
  assert failed.status_code == 500
  assert failed.json()['status'] == 'verification_failed'
  plain = setup_post(url, 'execute_with_verification', {
      'command': ['echo', 'x'], 'shell': False})
  assert plain.json()['output'] == 'x\n'


def test_setup_activate_and_close_window(url):
  for title in ('RlaFirst', 'RlaSecond'):
    setup_post(url, 'launch', {'command': ['xterm', '-T', title],
                               'shell': False})
  wait_for(lambda: {'RlaFirst', 'RlaSecond'} <= set(window_titles(url)),
           'two xterm windows')

  def active():
    return execute(url, ['xdotool', 'getactivewindow',
                         'getwindowname'])['output'].strip()
  for title in ('RlaFirst', 'RlaSecond'):
    answer = setup_post(url, 'activate_window', {
        'window_name': title, 'strict': True, 'by_class': False})
    assert (answer.status_code, answer.text) == (
        200, 'Window activated successfully')
    wait_for(lambda t=title: active() == t, f'{title} active')
  assert setup_post(url, 'activate_window', {
      'window_name': 'rlafirst', 'strict': True}).status_code == 404
  assert setup_post(url, 'activate_window', {
      'window_name': 'xterm', 'by_class': True}).status_code == 200
  answer = setup_post(url, 'close_window', {
      'window_name': 'rlafir', 'strict': False, 'by_class': False})
  assert (answer.status_code, answer.text) == (
      200, 'Window closed successfully.')
  wait_for(lambda: window_titles(url) == ['RlaSecond'], 'RlaFirst closed')
  assert setup_post(url, 'close_window', {
      'window_name': 'RlaNone'}).status_code == 404
  assert setup_post(url, 'close_window', {}).status_code == 400


def test_setup_open_file(url, desk):
  with open(os.path.join(desk.home, 'note.txt'), 'w') as f:
    f.write('hello')
  answer = setup_post(url, 'open_file', {'path': f'{APPS_HOME}/note.txt'})
  assert (answer.status_code, answer.text) == (
      200, 'File opened and window activated successfully')
  assert any('note.txt' in t and 'Mousepad' in t for t in window_titles(url))
  assert setup_post(url, 'open_file', {'path': 'xterm'}).status_code == 200
  assert setup_post(url, 'open_file', {
      'path': '~/missing.txt'}).status_code == 404
  assert setup_post(url, 'open_file', {
      'path': '/etc/hostname'}).status_code == 403


def test_what_needs_the_internet_answers_501(url):
  answer = setup_post(url, 'download_file', {'url': 'https://example.com/a',
                                             'path': '~/a'})
  assert answer.status_code == 501
  assert 'internet' in answer.json()['message']
