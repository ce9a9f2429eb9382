"""Files of a local desktop's home, for the OSWorld endpoints that name one.

Every path a request names must lie in the desktop's home: relative paths
and `~` start there; an absolute path is taken under the home as the apps
see it (their HOME, or OSWorld's /home/user, which task JSONs use) or under
the home's host path (the server's --home, or --trainer-home where a
root-started desktop sees the home elsewhere); `..` is refused, and so is a
symlink whose target leaves the home. Files are opened one directory at a
time without following symlinks, so swapping a directory for a symlink
mid-request cannot lead out either; only regular files are read or written
(a FIFO or /dev/zero is refused at once, not read forever), and sizes are
capped.

Standard library only (the system python3 runs it, from desktop_server.py).
"""

import os
import stat



OSWORLD_HOME = '/home/user'  # where OSWorld's task JSONs put files
FILE_LIMIT = 64 << 20  # bytes /file and /wallpaper serve
LIST_LIMIT = 20_000  # entries of one /list_directory tree


class RequestError(Exception):
  """A bad request: answered with this HTTP status and message."""

  def __init__(self, status, message):
    super().__init__(message)
    self.status = status



# -- files ----------------------------------------------------------------

def apps_home(desk):
  """The home as the apps see it: their HOME (the jail may mount it)."""
  return getattr(desk, 'env', {}).get('HOME') or desk.home


def _under(path, root):
  """path relative to root when inside it ('' for root itself), else None."""
  if path == root:
    return ''
  return path[len(root) + 1:] if path.startswith(root.rstrip('/') + '/') \
      else None


def host_path(desk, path):
  """The host path, inside the home, of a file the apps name (see top)."""
  if not isinstance(path, str) or not path or '\0' in path:
    raise RequestError(400, 'expected a file path')
  if '..' in path.split('/'):
    raise RequestError(403, f'refusing {path}: ".." is not allowed')
  if path == '~' or path.startswith('~/'):
    rel = path[2:]
  elif os.path.isabs(path):
    path = os.path.normpath(path)
    roots = (apps_home(desk), OSWORLD_HOME, desk.home, desk.trainer_home)
    rel = next((r for r in (_under(path, root) for root in roots if root)
                if r is not None), None)
    if rel is None:
      raise RequestError(403, f'refusing {path}: outside the home '
                         f'({apps_home(desk)})')
  else:
    rel = path
  home = os.path.realpath(desk.home)
  full = os.path.realpath(os.path.join(home, rel))
  if _under(full, home) is None:
    raise RequestError(403, f'refusing {path}: it leads out of the home '
                       '(a symlink)')
  return full


def to_host(desk, seen):
  """The host path of an apps' path in their home; others as they are."""
  rel = _under(os.path.normpath(seen), apps_home(desk))
  return seen if rel is None else os.path.join(desk.home, rel)


def apps_path(desk, host):
  """The path the apps see for a host path in the home."""
  rel = _under(host, os.path.realpath(desk.home))
  return os.path.join(apps_home(desk), rel) if rel else apps_home(desk)


def _open_in_home(desk, host, flags, make_dirs=False):
  """os.open of host (a realpath in the home), no symlink followed on the way.

  Walks from the home one directory at a time with O_NOFOLLOW, so a
  directory swapped for a symlink after host_path checked it fails here.
  """
  home = os.path.realpath(desk.home)
  parts = [p for p in _under(host, home).split('/') if p]
  if not parts:
    raise RequestError(400, f'{host} is a directory')
  fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  try:
    for part in parts[:-1]:
      if make_dirs:
        try:
          os.mkdir(part, 0o755, dir_fd=fd)
        except FileExistsError:
          pass
      inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW |
                      os.O_CLOEXEC, dir_fd=fd)
      os.close(fd)
      fd = inner
    return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK |
                   os.O_CLOEXEC, 0o644, dir_fd=fd)
  finally:
    os.close(fd)


def read_file(desk, path, limit=FILE_LIMIT):
  """The bytes of a regular file in the home; 4xx for anything else."""
  host = host_path(desk, path)
  try:
    fd = _open_in_home(desk, host, os.O_RDONLY)
  except FileNotFoundError as e:
    raise RequestError(404, f'file not found: {path}') from e
  except OSError as e:  # ELOOP, ENOTDIR: swapped for a symlink meanwhile
    raise RequestError(403, f'cannot open {path}: {e.strerror}') from e
  try:
    _check_regular(path, os.fstat(fd), limit)
  except RequestError:
    os.close(fd)
    raise
  with os.fdopen(fd, 'rb') as f:
    data = f.read(limit + 1)
  if len(data) > limit:  # it grew meanwhile
    raise RequestError(413, f'{path} is over {limit} bytes')
  return data


def _check_regular(path, info, limit):
  """RequestError unless info (an fstat) is a regular file within limit."""
  if stat.S_ISDIR(info.st_mode):
    raise RequestError(400, f'{path} is a directory')
  if not stat.S_ISREG(info.st_mode):
    raise RequestError(403, f'refusing {path}: not a regular file')
  if info.st_size > limit:
    raise RequestError(413, f'{path} has {info.st_size} bytes, over the '
                       f'{limit} this server sends')


def get_file(desk, request):
  """/file (form file_path): the file's bytes."""
  path = request.form().get('file_path')
  if not path:
    raise RequestError(400, 'form field "file_path" is required')
  return 200, read_file(desk, path)


def upload(desk, request):
  """/setup/upload (multipart file_path, file_data): writes the file."""
  fields = request.multipart()
  if 'file_path' not in fields or 'file_data' not in fields:
    raise RequestError(400, 'file_path and file_data are required')
  path = fields['file_path'].decode(errors='replace')
  host = host_path(desk, path)
  try:
    fd = _open_in_home(desk, host, os.O_WRONLY | os.O_CREAT, make_dirs=True)
  except OSError as e:
    raise RequestError(403, f'cannot write {path}: {e.strerror}') from e
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise RequestError(403, f'refusing {path}: not a regular file')
  with os.fdopen(fd, 'wb') as f:
    f.truncate()
    f.write(fields['file_data'])
  return 200, f'File Uploaded: {len(fields["file_data"])} bytes'


def list_directory(desk, request):
  """/list_directory {path}: the tree under a directory of the home."""
  path = request.json().get('path')
  if not path:
    return 400, {'error': "Missing 'path' parameter"}
  host = host_path(desk, str(path))
  if not os.path.isdir(host):
    return 400, {'error': 'The provided path is not a directory'}
  budget = [LIST_LIMIT]
  tree = _tree(host, budget)
  tree['name'] = os.path.basename(os.path.normpath(str(path)))
  return 200, {'directory_tree': tree}


def _tree(folder, budget):
  """OSWorld's nested dict; symlinks are leaves, at most LIST_LIMIT nodes."""
  tree = {'type': 'directory', 'name': os.path.basename(folder),
          'children': []}
  try:
    entries = sorted(os.scandir(folder), key=lambda e: e.name)
  except OSError as e:
    return {'error': str(e)}
  for entry in entries:
    if budget[0] <= 0:
      break
    budget[0] -= 1
    if entry.is_dir(follow_symlinks=False):
      tree['children'].append(_tree(entry.path, budget))
    else:
      tree['children'].append({'type': 'file', 'name': entry.name})
  return tree


def desktop_path(desk, _):
  """/desktop_path: ~/Desktop as the apps see it, 404 if there is none."""
  if not os.path.isdir(os.path.join(desk.home, 'Desktop')):
    return 404, {'error': 'Unsupported operating system or desktop path '
                 'not found'}
  return 200, {'desktop_path': os.path.join(apps_home(desk), 'Desktop')}


