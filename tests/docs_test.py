"""Checks on README.md and docs/: links resolve, the README is a short quick start, the guide is readable.

Plain pytest, no TensorFlow: it reads the Markdown files only.

* Every relative link (`[text](path)`, `![alt](path)`, `[text](path#anchor)`, `[text](#anchor)`) outside code, in
  README.md, the user guide (docs/*.md) and the research record (docs/research/*.md), resolves to an existing
  path, relative to the file that contains it; an `#anchor` names a heading of the target (GitHub's slugs: lower
  case, punctuation dropped, spaces to hyphens, `-1`, `-2`, ... for repeated headings).
* README.md, outside fenced code blocks: exactly one line starting with `# ` (its title: it is also setup.py's
  long_description), at most `README_MAX_WORDS` words, no paragraph, list item or table row over
  `README_MAX_BLOCK` characters.
* The user guide (docs/*.md, not docs/research/): no paragraph, list item or table row over `GUIDE_MAX_BLOCK`
  characters; each page opens, right under its title, with one short paragraph saying what a user does there
  ("Use this page to ..."); no issue numbers or dates in its prose or the README's (they belong to the record).
* Each report of the research record opens with its summary table.
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
RESEARCH = os.path.join(DOCS, 'research')
README_MAX_WORDS = 1000
README_MAX_BLOCK = 600
GUIDE_MAX_BLOCK = 1000
OPENING_MAX = 300
OPENING_START = 'Use this page to '

_FENCE = re.compile(r'^ {0,3}(`{3,}|~{3,})')
_INLINE_CODE = re.compile(r'(`+)(?:(?!\1).)+?\1')
# `[text](target)` or `![alt](target "title")`; the text may hold one level of brackets (`[`x`](y)`).
_LINK = re.compile(r'!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+"[^"]*")?\s*\)')
_REFERENCE_DEFINITION = re.compile(r'^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$')
_HEADING = re.compile(r'^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$')
_EXTERNAL = re.compile(r'^[a-zA-Z][a-zA-Z0-9+.-]*:')  # http:, https:, mailto:, ...
_LIST_ITEM = re.compile(r'^ {0,3}(?:[-*+]|\d+[.)])\s+')
_LINK_TARGET = re.compile(r'\]\([^)]*\)')
_HISTORY = re.compile(r'\b[Ii]ssues? \d+|\b20\d\d-\d\d-\d\d\b')



@pytest.fixture(scope='module', autouse=True)
def simulation_context():
  """Overrides tests/conftest.py's fixture of that name: these checks read Markdown only (no TFF, no worker)."""
  yield None


def _pages(directory: str) -> list[str]:
  return sorted(os.path.join(directory, name) for name in os.listdir(directory)
                if name.endswith('.md') and os.path.isfile(os.path.join(directory, name)))


def guide_files() -> list[str]:
  """The user guide: docs/*.md."""
  return _pages(DOCS)


def research_files() -> list[str]:
  """The research record: docs/research/*.md."""
  return _pages(RESEARCH) if os.path.isdir(RESEARCH) else []


def markdown_files() -> list[str]:
  return [README] + guide_files() + research_files()


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


def blocks(text: str) -> list[tuple[int, str]]:
  """(first line number, text) of every paragraph, list item, table row and heading outside fenced code.

  A paragraph's or list item's lines are joined by one space (each stripped); a list item ends at the next item,
  a blank line, a heading, a table row or a code fence.
  """
  found: list[tuple[int, str]] = []
  current: list[str] = []
  start = 0
  previous = None

  def flush():
    if current:
      found.append((start, ' '.join(current)))
      current.clear()

  for number, line in outside_fences(text):
    if previous is not None and number != previous + 1:  # A code block lay between.
      flush()
    previous = number
    stripped = line.strip()
    if not stripped:
      flush()
    elif _HEADING.match(line) or stripped.startswith('|'):
      flush()
      found.append((number, stripped))
    else:
      if _LIST_ITEM.match(line):
        flush()
      if not current:
        start = number
      current.append(stripped)
  flush()
  return found


def prose_blocks(text: str) -> list[tuple[int, str]]:
  """`blocks` less the headings."""
  return [(number, block) for number, block in blocks(text) if not _HEADING.match(block)]


def words_outside_code(text: str) -> int:
  """Words (whitespace-separated tokens holding a letter or digit) outside fenced code blocks."""
  return sum(1 for _, line in outside_fences(text) for token in line.split() if re.search(r'\w', token))


def opening(text: str) -> str | None:
  """The first block after the page's `# ` title, if it is a paragraph (not a heading, list, table or code)."""
  lines = text.splitlines()
  if not lines or not lines[0].startswith('# '):
    return None
  after = blocks(text)[1:]
  if not after:
    return None
  number, block = after[0]
  body = '\n'.join(lines[1:number - 1])
  if body.strip() or _HEADING.match(block) or block.startswith('|') or _LIST_ITEM.match(block):
    return None  # Code (or nothing parsed) between the title and the block, or not a paragraph.
  return block


def _read(path: str) -> str:
  with open(path, encoding='utf-8') as f:
    return f.read()


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
  count = words_outside_code(_read(README))
  assert count <= README_MAX_WORDS, (
      f'README.md has {count} words outside code blocks (at most {README_MAX_WORDS}); move the detail into docs/')


def test_readme_paragraphs_are_short():
  long = [(number, len(block)) for number, block in prose_blocks(_read(README)) if len(block) > README_MAX_BLOCK]
  assert not long, (f'README.md: paragraphs, list items or table rows over {README_MAX_BLOCK} characters '
                    f'(line, length): {long}')


@pytest.mark.parametrize('path', guide_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_guide_paragraphs_are_short(path):
  long = [(number, len(block)) for number, block in prose_blocks(_read(path)) if len(block) > GUIDE_MAX_BLOCK]
  assert not long, (f'{os.path.relpath(path, ROOT)}: paragraphs, list items or table rows over {GUIDE_MAX_BLOCK} '
                    f'characters (line, length); split or cut them: {long}')


@pytest.mark.parametrize('path', guide_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_guide_page_opens_with_what_the_user_does_there(path):
  first = opening(_read(path))
  where = os.path.relpath(path, ROOT)
  assert first is not None, f'{where}: the title must be followed by a paragraph saying what a user does here'
  assert first.startswith(OPENING_START), f'{where}: its first paragraph must start {OPENING_START!r}: {first!r}'
  assert len(first) <= OPENING_MAX, f'{where}: its first paragraph is {len(first)} characters (at most {OPENING_MAX})'


@pytest.mark.parametrize('path', [README] + guide_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_readme_and_guide_hold_no_history(path):
  found = [(number, match.group(0)) for number, block in prose_blocks(_read(path))
           for match in _HISTORY.finditer(_LINK_TARGET.sub('](...)', _INLINE_CODE.sub('', block)))]
  assert not found, (f'{os.path.relpath(path, ROOT)}: issue numbers or dates (line, text); they belong to the '
                     f'research record, docs/research/: {found}')


@pytest.mark.parametrize('path', [p for p in research_files() if os.path.basename(p) != 'README.md'],
                         ids=lambda p: os.path.relpath(p, ROOT))
def test_research_report_opens_with_its_summary_table(path):
  head = blocks(_read(path))[1:4]
  assert any(block.startswith('|') for _, block in head), (
      f'{os.path.relpath(path, ROOT)}: a report opens with its summary table (within its first three blocks)')


def test_research_record_has_an_index():
  index = os.path.join(RESEARCH, 'README.md')
  assert os.path.isfile(index), 'docs/research/README.md, the index of the research record, is missing'
  linked = {os.path.normpath(os.path.join(RESEARCH, target.partition('#')[0])) for _, target in links(index)}
  missing = [os.path.basename(p) for p in research_files() if p != index and p not in linked]
  assert not missing, f'docs/research/README.md does not link these reports: {missing}'


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


def test_blocks_split_paragraphs_items_and_rows():
  text = ('# Title\n\nUse this page to\nread.\n\n- one\n  more\n- two\n\n| a | b |\n|---|---|\n\n'
          '```text\nlong code\n```\nafter code\n\n## H\n')
  assert blocks(text) == [(1, '# Title'), (3, 'Use this page to read.'), (6, '- one more'), (8, '- two'),
                          (10, '| a | b |'), (11, '|---|---|'), (16, 'after code'), (18, '## H')]
  assert opening(text) == 'Use this page to read.'
  assert opening('# Title\n\n## Section\n\ntext\n') is None
  assert opening('# Title\n\n```\ncode\n```\n\ntext\n') is None
  assert words_outside_code('# A title\n\n```\nnot counted here\n```\n| x | y |\n') == 4


def test_the_gates_fail_on_a_long_readme():
  long_paragraph = ' '.join(['word'] * 150)  # 749 characters, 150 words.
  text = '# Title\n\n' + '\n\n'.join([long_paragraph] * 7) + '\n'
  assert words_outside_code(text) > README_MAX_WORDS
  assert max(len(block) for _, block in prose_blocks(text)) > README_MAX_BLOCK
  assert _HISTORY.search('Measured 2026-11-27 (issue 38)')
