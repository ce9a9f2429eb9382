"""The desktop's accessibility tree as OSWorld's XML (desktop_server.py).

Walks the AT-SPI tree of every application with pyatspi (system python3)
within a node and time budget, so a hung or huge app never hangs the
server; element tags are role names, states go in st:, attributes in
attr:, screen position and size in cp:, values in val:, actions in act:.
"""

import time
import xml.etree.ElementTree as ET

import pyatspi  # before gi.repository: it picks the Atspi version
from gi.repository import GLib  # pylint: disable=wrong-import-order

A11Y_TIME_BUDGET_S = 2.0
A11Y_MAX_NODES = 5000
A11Y_MAX_DEPTH = 50
A11Y_MAX_WIDTH = 1024  # children per node, OSWorld's MAX_WIDTH
A11Y_MAX_TEXT = 100_000  # characters of one node's text
A11Y_CALL_TIMEOUT_MS = 1000  # one AT-SPI call to a hung app
NS = {  # OSWorld's namespaces for the Ubuntu tree
    'st': 'https://accessibility.ubuntu.example.org/ns/state',
    'attr': 'https://accessibility.ubuntu.example.org/ns/attributes',
    'cp': 'https://accessibility.ubuntu.example.org/ns/component',
    'val': 'https://accessibility.ubuntu.example.org/ns/value',
    'act': 'https://accessibility.ubuntu.example.org/ns/action',
}


class _Budget:
  """Nodes and time left for one tree; a walk past either stops early."""

  def __init__(self):
    self.deadline = time.monotonic() + A11Y_TIME_BUDGET_S
    self.nodes = A11Y_MAX_NODES
    self.truncated = False

  def take(self):
    if self.nodes <= 0 or time.monotonic() > self.deadline:
      self.truncated = True
      return False
    self.nodes -= 1
    return True


def _xml_text(s):
  """s without the characters XML 1.0 cannot hold."""
  return ''.join(c for c in s if c in '\t\n\r' or
                 ('\x20' <= c <= '\ud7ff') or ('\ue000' <= c <= '\ufffd') or
                 c >= '\U00010000')


def _xml_name(s):
  """s as an XML tag or attribute name."""
  s = ''.join(c if c.isalnum() or c in '-_.' else '-' for c in s.strip())
  if not s:
    return 'unknown'
  return s if s[0].isalpha() else 'x' + s


def _details(node, attrib):
  """OSWorld's image / selection flags, val: and act: attributes."""
  for flag, query in (('image', 'queryImage'), ('selection',
                                                'querySelection')):
    try:
      getattr(node, query)()
      attrib[flag] = 'true'
    except Exception:  # pylint: disable=broad-except
      pass
  try:
    v = node.queryValue()
    for key, get in (('value', 'currentValue'), ('min', 'minimumValue'),
                     ('max', 'maximumValue'), ('step', 'minimumIncrement')):
      attrib['{%s}%s' % (NS['val'], key)] = str(getattr(v, get))
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    a = node.queryAction()
    for i in range(a.nActions):
      key = '{%s}%s' % (NS['act'], _xml_name(a.getName(i)))
      attrib[key + '_desc'] = _xml_text(a.getDescription(i) or '')
      attrib[key + '_kb'] = _xml_text(a.getKeyBinding(i) or '')
  except Exception:  # pylint: disable=broad-except
    pass


def _a11y_node(node, depth, budget):
  """One node and (within budget) its subtree as an Element, None if dead."""
  if not budget.take():
    return None
  try:
    role = node.getRoleName() or 'unknown'
    attrib = {'name': _xml_text(node.name or '')}
    states = node.getState().getStates()
  except Exception:  # pylint: disable=broad-except
    return None  # the app died or hung: skip it
  st = '{%s}' % NS['st']
  for state in states:
    name = pyatspi.StateType._enum_lookup.get(int(state), '')  # pylint: disable=protected-access
    if name.startswith('STATE_'):
      attrib[st + name[6:].lower()] = 'true'
  try:
    for key, value in (node.get_attributes() or {}).items():
      if key:
        attrib['{%s}%s' % (NS['attr'], _xml_name(key))] = _xml_text(value)
  except Exception:  # pylint: disable=broad-except
    pass
  if attrib.get(st + 'visible') and attrib.get(st + 'showing'):
    try:
      x, y, w, h = node.queryComponent().getExtents(pyatspi.XY_SCREEN)
      attrib['{%s}screencoord' % NS['cp']] = str((x, y))
      attrib['{%s}size' % NS['cp']] = str((w, h))
    except Exception:  # pylint: disable=broad-except
      pass
  text = ''
  try:
    t = node.queryText()
    text = t.getText(0, min(t.characterCount, A11Y_MAX_TEXT))
    text = _xml_text(text.replace('\ufffc', '').replace('\ufffd', ''))
  except Exception:  # pylint: disable=broad-except
    pass
  if attrib.get(st + 'showing'):  # hidden nodes (closed menus): no details
    _details(node, attrib)
  element = ET.Element(_xml_name(role.replace(' ', '-')), attrib)
  if text:
    element.text = text
  if depth < A11Y_MAX_DEPTH:
    _append_children(element, node, depth + 1, budget, A11Y_MAX_WIDTH)
  return element


def _append_children(element, node, depth, budget, width=None):
  """The live children of `node` (the first `width`) as subtrees of
  `element`; a child that is gone or hangs is skipped."""
  try:
    count = node.childCount
  except Exception:  # pylint: disable=broad-except
    return
  for i in range(count if width is None else min(count, width)):
    try:
      child = node.getChildAtIndex(i)
    except Exception:  # pylint: disable=broad-except
      continue
    if child is not None:
      sub = _a11y_node(child, depth, budget)
      if sub is not None:
        element.append(sub)


def accessibility_tree():
  """The desktop's AT-SPI tree as OSWorld's XML string."""
  # Events (apps that appeared or went, changed states) wait in the GLib
  # queue of this thread: take them in so that AT-SPI's cache is current.
  context = GLib.MainContext.default()
  for _ in range(100_000):
    if not context.iteration(False):
      break
  root = ET.Element('desktop-frame')
  budget = _Budget()
  _append_children(root, pyatspi.Registry.getDesktop(0), 1, budget)
  if budget.truncated:
    root.set('truncated', 'true')
  return ET.tostring(root, encoding='unicode')
