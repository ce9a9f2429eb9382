"""Windows, the wallpaper and screen recording of a local desktop, for the
OSWorld endpoints that need them (desktop_setup.py routes them).

Window queries and the wallpaper use the server's own X connection (EWMH
through Xlib, with wmctrl's matching rules); a recording runs Debian's
ffmpeg (x11grab) outside the apps' jail with a fixed command line that
holds nothing from the request, and answers 501 where ffmpeg is missing.

Imports only the standard library, PIL and Xlib (and desktop_a11y, next to
it, when /terminal is asked): the system python3 runs it.
"""

import io
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import xml.etree.ElementTree as ET

from PIL import Image
import Xlib.error
import Xlib.X
from Xlib.ext import xtest
from Xlib.protocol import event as xevent


import desktop_files  # this folder (the script's)
import desktop_jail

# -- windows --------------------------------------------------------------

def windows(desk):
  """[(window id, title, WM_CLASS tuple)] of the managed windows."""

  def listing(d):
    found = []
    clients = d.screen().root.get_full_property(
        d.intern_atom('_NET_CLIENT_LIST'), Xlib.X.AnyPropertyType)
    for wid in (clients.value if clients else []):
      window = d.create_resource_object('window', wid)
      try:
        name = window.get_full_property(d.intern_atom('_NET_WM_NAME'),
                                        d.intern_atom('UTF8_STRING'))
        title = (name.value.decode(errors='replace') if name else
                 window.get_wm_name() or '')
        found.append((wid, str(title), tuple(window.get_wm_class() or ())))
      except Xlib.error.XError:  # gone meanwhile
        continue
    return found
  return desk.with_x(listing)


def _matching(desk, name, strict, by_class):
  """The first window matching name as `wmctrl [-x] [-F]` would."""
  for wid, title, wm_class in windows(desk):
    if by_class:
      labels = ['.'.join(wm_class)] + list(wm_class)
    else:
      labels = [title]
    if any(label == name if strict else name.lower() in label.lower()
           for label in labels):
      return wid
  return None


def _ewmh(desk, wid, message, data):
  """Sends the EWMH client message to the window manager for window wid."""

  def send(d):
    root = d.screen().root
    ev = xevent.ClientMessage(
        window=d.create_resource_object('window', wid),
        client_type=d.intern_atom(message), data=(32, data + [0] * (5 - len(
            data))))
    root.send_event(ev, event_mask=(Xlib.X.SubstructureRedirectMask |
                                    Xlib.X.SubstructureNotifyMask))
    d.sync()
  desk.with_x(send)


def activate(desk, wid):
  _ewmh(desk, wid, '_NET_ACTIVE_WINDOW', [2, Xlib.X.CurrentTime])


def _window_request(request):
  data = request.json()
  name = data.get('window_name')
  if not name:
    raise desktop_files.RequestError(400, 'window_name required')
  return str(name), bool(data.get('strict')), bool(data.get('by_class'))


def activate_window(desk, request):
  """/setup/activate_window {window_name, strict, by_class}."""
  name, strict, by_class = _window_request(request)
  wid = _matching(desk, name, strict, by_class)
  if wid is None:
    return 404, f'Window {name} not found'
  activate(desk, wid)
  return 200, 'Window activated successfully'


def close_window(desk, request):
  """/setup/close_window {window_name, strict, by_class}: asks it to close."""
  name, strict, by_class = _window_request(request)
  wid = _matching(desk, name, strict, by_class)
  if wid is None:
    return 404, f'Window {name} not found'
  _ewmh(desk, wid, '_NET_CLOSE_WINDOW', [Xlib.X.CurrentTime, 2])
  return 200, 'Window closed successfully.'


def window_size(desk, request):
  """/window_size (form app_class_name): the first such window's size."""
  name = request.form().get('app_class_name')
  if not name:
    return 400, {'error': 'app_class_name is required'}
  for wid, _, wm_class in windows(desk):
    if name.lower() in (c.lower() for c in wm_class):
      try:
        geometry = desk.with_x(
            lambda d, w=wid: d.create_resource_object(
                'window', w).get_geometry())
      except Xlib.error.XError:
        continue
      return 200, {'width': geometry.width, 'height': geometry.height}
  return 404, {'error': f'no window of class {name}'}


def cursor_position(desk, _):
  """/cursor_position: [x, y] of the mouse."""
  pointer = desk.with_x(lambda d: d.screen().root.query_pointer())
  return 200, [pointer.root_x, pointer.root_y]


def terminal(desk, _):
  """/terminal: the text of the focused terminal of the active window.

  Read from the accessibility tree as OSWorld does (a terminal element,
  focused, in an active frame); output is null when there is none (xterm
  has no accessibility).
  """
  # Next to this file, with pyatspi: the server has imported it already
  # (a lazy import keeps this module importable where pyatspi is not).
  import desktop_a11y  # pylint: disable=import-outside-toplevel
  with desk.a11y_lock:
    tree = ET.fromstring(desktop_a11y.accessibility_tree())
  state = '{' + desktop_a11y.NS['st'] + '}'
  for frame in tree.iter('frame'):
    if frame.get(state + 'active') != 'true':
      continue
    for node in frame.iter('terminal'):
      if node.get(state + 'focused') == 'true':
        return 200, {'output': (node.text or '').rstrip(),
                     'status': 'success'}
  return 200, {'output': None, 'status': 'success'}


# -- wallpaper ------------------------------------------------------------

class _State:
  """What lives across requests: the wallpaper set, the recording."""

  def __init__(self):
    self.lock = threading.Lock()
    self.wallpaper = None  # host path of the picture
    self.recording = None  # (Popen, folder) of ffmpeg


STATE = _State()


def change_wallpaper(desk, request):
  """/setup/change_wallpaper {path}: paints the picture on the root window.

  No desktop shell runs, so the picture is drawn as the X root window's
  background (what screenshots show behind the windows); /wallpaper
  returns the file.
  """
  path = request.json().get('path')
  if not path:
    return 400, 'Path not supplied!'
  try:
    data = desktop_files.read_file(desk, str(path))
  except desktop_files.RequestError as e:
    if e.status == 404:
      return 404, f'File not found: {path}'
    raise
  try:
    image = Image.open(io.BytesIO(data))
    image.load()
  except (OSError, ValueError, Image.DecompressionBombError) as e:
    return 400, f'Failed to change wallpaper. Error: not a picture: {e}'
  desk.with_x(lambda d: _paint_root(d, image))
  STATE.wallpaper = desktop_files.host_path(desk, str(path))
  return 200, 'Wallpaper changed successfully'


def _paint_root(d, image):
  """Sets image, scaled to the screen, as the root window's background."""
  screen = d.screen()
  root, depth = screen.root, screen.root_depth
  width, height = screen.width_in_pixels, screen.height_in_pixels
  if depth not in (24, 32):
    raise desktop_files.RequestError(501, f'cannot paint a {depth}-bit screen')
  raw = image.convert('RGB').resize((width, height)).tobytes('raw', 'BGRX')
  pixmap = root.create_pixmap(width, height, depth)
  gc = pixmap.create_gc()
  rows = max(1, 200_000 // (4 * width))  # one X request stays under 256 KB
  for y in range(0, height, rows):
    n = min(rows, height - y)
    pixmap.put_image(gc, 0, y, width, n, Xlib.X.ZPixmap, depth, 0,
                     raw[4 * width * y:4 * width * (y + n)])
  root.change_attributes(background_pixmap=pixmap)
  root.clear_area(0, 0, width, height)
  gc.free()
  pixmap.free()
  d.sync()


def wallpaper(desk, _):
  """/wallpaper: the picture /setup/change_wallpaper set, 404 if none."""
  if STATE.wallpaper is None:
    return 404, 'Wallpaper file not found'
  try:
    return 200, desktop_files.read_file(desk, STATE.wallpaper), 'image/png'
  except desktop_files.RequestError as e:
    return (404, 'Wallpaper file not found') if e.status == 404 else (
        e.status, str(e))


def unpaint_root(d):
  root = d.screen().root
  root.change_attributes(background_pixmap=Xlib.X.NONE)
  root.clear_area(0, 0, 0, 0)
  d.sync()


# -- recording ------------------------------------------------------------

def start_recording(desk, _):
  """/start_recording: ffmpeg grabs the screen until /end_recording.

  ffmpeg runs with a fixed argv outside the apps' jail (nothing of the
  request reaches it) and writes to a folder of the server's own.
  """
  ffmpeg = shutil.which('ffmpeg')
  if not ffmpeg:
    return _no_ffmpeg()
  with STATE.lock:
    if STATE.recording and STATE.recording[0].poll() is None:
      return 400, {'status': 'error',
                   'message': 'Recording is already in progress.'}
    width, height = desk.screen_size()
    folder = tempfile.mkdtemp(prefix='rla_recording_')
    with open(os.path.join(folder, 'ffmpeg.log'), 'wb') as log:
      proc = subprocess.Popen(
          [ffmpeg, '-y', '-f', 'x11grab', '-draw_mouse', '1', '-s',
           f'{width}x{height}', '-i', desk.display_name, '-c:v', 'libx264',
           '-pix_fmt', 'yuv420p', '-r', '30',
           os.path.join(folder, 'recording.mp4')],
          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
          start_new_session=True)
    STATE.recording = proc, folder
  try:
    proc.wait(1.0)
  except subprocess.TimeoutExpired:
    return 200, {'status': 'success',
                 'message': 'Started recording successfully.'}
  log = stop_recording()[1]
  return 500, {'status': 'error', 'message': 'Failed to start recording. '
               f'ffmpeg terminated unexpectedly. Error: {log}'}


def end_recording(desk, _):
  """/end_recording: stops ffmpeg; the video's bytes (MP4)."""
  del desk
  if not shutil.which('ffmpeg'):
    return _no_ffmpeg()
  with STATE.lock:
    running = STATE.recording and STATE.recording[0].poll() is None
  if not running:
    log = stop_recording()[1]
    return 400, {'status': 'error', 'message': 'No recording in progress '
                 f'to stop. FFmpeg log: {log}'}
  video, log = stop_recording()
  if not video:
    return 500, {'status': 'error', 'message': 'Recording failed. The '
                 f'output file is missing or empty. ffmpeg stderr: {log}'}
  return 200, video, 'video/mp4'


def _no_ffmpeg():
  return 501, {'status': 'error', 'message': 'screen recording needs '
               'ffmpeg, which is not installed on this host (apt-get '
               'install ffmpeg)'}


def stop_recording():
  """(video bytes or b'', ffmpeg's log) of the recording, which ends."""
  with STATE.lock:
    recording, STATE.recording = STATE.recording, None
  if recording is None:
    return b'', ''
  proc, folder = recording
  if proc.poll() is None:
    proc.send_signal(signal.SIGINT)  # ffmpeg finishes the file
    try:
      proc.wait(15)
    except subprocess.TimeoutExpired:
      desktop_jail.kill(-proc.pid)
      proc.wait()
  try:
    with open(os.path.join(folder, 'ffmpeg.log'), 'rb') as f:
      log = f.read()[-4000:].decode(errors='replace')
    video = os.path.join(folder, 'recording.mp4')
    if not os.path.exists(video):
      return b'', log
    with open(video, 'rb') as f:
      return f.read(), log
  finally:
    shutil.rmtree(folder, ignore_errors=True)


# -- the screen's input and cursor (the server's screenshot and reset) -----

def cursor(desk):
  """(RGBA image, top-left x, y) of the mouse cursor, or None."""

  def grab(d):
    if not d.has_extension('XFIXES'):
      return None
    d.xfixes_query_version()
    c = d.xfixes_get_cursor_image(d.screen().root)
    if not c.width or not c.height:
      return None
    data = struct.pack(f'={len(c.cursor_image)}I', *c.cursor_image)
    raw = 'BGRA' if sys.byteorder == 'little' else 'ARGB'
    image = Image.frombytes('RGBA', (c.width, c.height), data, 'raw', raw)
    return image, c.x - c.xhot, c.y - c.yhot
  try:
    return desk.with_x(grab)
  except Exception:  # pylint: disable=broad-except
    return None  # the cursor is optional

def close_windows_and_release_input(desk):
  """Disconnects every managed window's client; releases keys, buttons."""

  def run(d):
    root = d.screen().root
    clients = root.get_full_property(d.intern_atom('_NET_CLIENT_LIST'),
                                     Xlib.X.AnyPropertyType)
    catch = Xlib.error.CatchError()
    for window in (clients.value if clients else []):
      d.create_resource_object('window', window).kill_client(onerror=catch)
    keymap = d.query_keymap()
    for i, byte in enumerate(keymap):
      for bit in range(8):
        if byte >> bit & 1:
          xtest.fake_input(d, Xlib.X.KeyRelease, i * 8 + bit)
    mask = root.query_pointer().mask
    for button in range(1, 6):
      if mask & (Xlib.X.Button1Mask << (button - 1)):
        xtest.fake_input(d, Xlib.X.ButtonRelease, button)
    screen = d.screen()
    root.warp_pointer(screen.width_in_pixels // 2,
                      screen.height_in_pixels // 2)
    d.sync()
  desk.with_x(run)
