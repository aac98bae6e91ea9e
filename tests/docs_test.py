"""Checks on README.md and docs/*.md: links resolve, one top-level heading, README stays short, no archives in docs/.

Plain pytest, no TensorFlow: it reads the Markdown files only.

* Every relative link (`[text](path)`, `![alt](path)`, `[text](path#anchor)`, `[text](#anchor)`) outside code
  resolves to an existing path, relative to the file that contains it; an `#anchor` names a heading of the target
  (GitHub's slugs: lower case, punctuation dropped, spaces to hyphens, `-1`, `-2`, ... for repeated headings).
* README.md has at most `README_MAX_LINES` lines and, outside fenced code blocks, exactly one line starting with
  `# ` (its title): it is also setup.py's long_description.
* No `*.tar.gz` lies under docs/ (the studies' run archives live in archives/).
"""

import os
import re
import unicodedata
from urllib.parse import unquote

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, 'README.md')
DOCS = os.path.join(ROOT, 'docs')
README_MAX_LINES = 200

_FENCE = re.compile(r'^ {0,3}(`{3,}|~{3,})')
_INLINE_CODE = re.compile(r'(`+)(?:(?!\1).)+?\1')
# `[text](target)` or `![alt](target "title")`; the text may hold one level of brackets (`[`x`](y)`).
_LINK = re.compile(r'!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+"[^"]*")?\s*\)')
_REFERENCE_DEFINITION = re.compile(r'^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$')
_HEADING = re.compile(r'^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$')
_EXTERNAL = re.compile(r'^[a-zA-Z][a-zA-Z0-9+.-]*:')  # http:, https:, mailto:, ...



@pytest.fixture(scope='module', autouse=True)
def simulation_context():
  """Overrides tests/conftest.py's fixture of that name: these checks read Markdown only (no TFF, no worker)."""
  yield None


def markdown_files() -> list[str]:
  files = [README] + sorted(
      os.path.join(DOCS, name) for name in os.listdir(DOCS) if name.endswith('.md'))
  return [f for f in files if os.path.isfile(f)]


def outside_fences(text: str) -> list[tuple[int, str]]:
  """(line number, line) of every line outside fenced code blocks (``` or ~~~, CommonMark's closing rule)."""
  lines = []
  fence = None
  for number, line in enumerate(text.splitlines(), start=1):
    match = _FENCE.match(line)
    if fence is None:
      if match:
        fence = match.group(1)
      else:
        lines.append((number, line))
    elif (match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence)
          and not line[match.end():].strip()):
      fence = None
  return lines


def prose_lines(text: str) -> list[tuple[int, str]]:
  """`outside_fences` with inline code spans removed."""
  return [(number, _INLINE_CODE.sub('', line)) for number, line in outside_fences(text)]


def slugify(heading: str) -> str:
  """GitHub's anchor for a heading's text (before de-duplication)."""
  text = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', heading)  # Links and images: their text.
  text = re.sub(r'<[^>]+>', '', text)  # HTML tags.
  text = text.replace('`', '').lower()
  kept = []
  for ch in text:
    category = unicodedata.category(ch)
    if ch in ' -_' or category[0] in 'LN' or category == 'Mn':
      kept.append(ch)
  return ''.join(kept).replace(' ', '-')


def anchors(path: str) -> set[str]:
  with open(path, encoding='utf-8') as f:
    text = f.read()
  seen: dict[str, int] = {}
  result = set()
  for _, line in outside_fences(text):
    heading = _HEADING.match(line)
    if not heading:
      continue
    slug = slugify(heading.group(2))
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    result.add(slug if count == 0 else f'{slug}-{count}')
  for name in re.findall(r'<a\s+(?:name|id)="([^"]+)"', text):  # Explicit HTML anchors.
    result.add(name)
  return result


def links(path: str) -> list[tuple[int, str]]:
  """(line number, target) of every link in the prose of `path`."""
  with open(path, encoding='utf-8') as f:
    text = f.read()
  found = []
  for number, line in prose_lines(text):
    found.extend((number, target) for target in _LINK.findall(line))
    definition = _REFERENCE_DEFINITION.match(line)
    if definition:
      found.append((number, definition.group(1)))
  return found


def relative_links():
  for path in markdown_files():
    for number, target in links(path):
      if target and not _EXTERNAL.match(target):
        yield path, number, target


def _link_id(value) -> str:
  if isinstance(value, tuple):
    path, number, target = value
    return f'{os.path.relpath(path, ROOT)}:{number}:{target}'
  return str(value)


def test_finds_the_docs_and_their_links():
  names = [os.path.relpath(p, ROOT) for p in markdown_files()]
  assert 'README.md' in names and len(names) > 1, names
  assert any(os.path.relpath(p, ROOT) == 'README.md' for p, _, _ in relative_links())


@pytest.mark.parametrize('link', list(relative_links()), ids=_link_id)
def test_relative_link_resolves(link):
  path, number, target = link
  where = f'{os.path.relpath(path, ROOT)}:{number}'
  file_part, _, fragment = target.partition('#')
  file_part = unquote(file_part.split('?', 1)[0])
  if file_part.startswith('/'):
    resolved = os.path.join(ROOT, file_part.lstrip('/'))
  else:
    resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
  assert os.path.exists(resolved), f'{where}: link {target!r}: {os.path.relpath(resolved, ROOT)} does not exist'
  assert os.path.realpath(resolved).startswith(ROOT + os.sep), f'{where}: link {target!r} leaves the repository'
  if fragment:
    assert resolved.endswith('.md') and os.path.isfile(resolved), (
        f'{where}: link {target!r}: an anchor into a file that is not Markdown')
    available = anchors(resolved)
    assert unquote(fragment) in available, (
        f'{where}: link {target!r}: no heading with anchor #{fragment} in {os.path.relpath(resolved, ROOT)} '
        f'(its anchors: {sorted(available)})')


def test_readme_is_short():
  with open(README, encoding='utf-8') as f:
    count = len(f.read().splitlines())
  assert count <= README_MAX_LINES, (
      f'README.md has {count} lines (at most {README_MAX_LINES}); move the detail into docs/')


def test_readme_has_one_top_level_heading():
  with open(README, encoding='utf-8') as f:
    text = f.read()
  assert text.startswith('# '), 'README.md must start with its title, a `# ` heading'
  top = [(number, line) for number, line in prose_lines(text) if line.startswith('# ')]
  assert [number for number, _ in top] == [1], (
      f'README.md: top-level headings outside code blocks besides the title: {top[1:]}')


def test_no_archives_under_docs():
  archives = []
  for directory, _, files in os.walk(DOCS):
    archives.extend(os.path.relpath(os.path.join(directory, f), ROOT) for f in files if f.endswith('.tar.gz'))
  assert not archives, f'run archives belong in archives/, not docs/: {archives}'


# --- The checker itself. ---------------------------------------------------------------------------------------


@pytest.mark.parametrize('heading, slug', [
    ("RFA's measured limit", 'rfas-measured-limit'),
    ('The walk of one parameter: tau', 'the-walk-of-one-parameter-tau'),
    ('GMA vs averaging: the GMA study', 'gma-vs-averaging-the-gma-study'),
    ('Where Weiszfeld starts: the default is the zero update', 'where-weiszfeld-starts-the-default-is-the-zero-update'),
    ('One experiment: `python -m training.run`', 'one-experiment-python--m-trainingrun'),
    ('The library, `tff_gma/`', 'the-library-tff_gma'),
    ('What a PASS establishes, and what it does not', 'what-a-pass-establishes-and-what-it-does-not'),
])
def test_slugify_is_githubs(heading, slug):
  assert slugify(heading) == slug


def test_parsing_skips_code_and_finds_links(tmp_path):
  page = tmp_path / 'page.md'
  page.write_text(
      '# Title\n\n'
      'See [a](a.md#x-y), ![img](pic.png "t"), [`code`](b.md) and `[not](a link)`.\n\n'
      '```text\n# not a heading\n[not](a link)\n```\n\n'
      '## X y\n\n## X y\n\n[ref]: c.md\n',
      encoding='utf-8')
  assert [t for _, t in links(str(page))] == ['a.md#x-y', 'pic.png', 'b.md', 'c.md']
  assert anchors(str(page)) == {'title', 'x-y', 'x-y-1'}
  assert [n for n, line in prose_lines(page.read_text()) if line.startswith('# ')] == [1]
