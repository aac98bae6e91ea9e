"""The installable package: exactly `tff_gma`, every third-party import declared, no harness behind the library;
the Python range that setup.py, the README and the pins state is one range, and the README's install route for a
library user works in a fresh venv."""

import ast
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile

from packaging.specifiers import SpecifierSet
import pytest

import tests


@pytest.fixture(scope='module', autouse=True)
def simulation_context():
  """Overrides tests/conftest.py's fixture: these checks read files and run subprocesses (no TFF worker here)."""
  yield None


# Import name -> distribution name, for the third-party packages the library may import.
_DISTRIBUTIONS = {
    'absl': 'absl-py', 'grpc': 'grpcio', 'numpy': 'numpy', 'portpicker': 'portpicker', 'sklearn': 'scikit-learn',
    'tensorflow': 'tensorflow', 'tensorflow_datasets': 'tensorflow-datasets',
    'tensorflow_federated': 'tensorflow-federated',
}


def _library_imports() -> set[str]:
  """Top-level names of every module that some file of `tff_gma/` imports (at any depth of the file)."""
  names = set()
  for folder, _, files in os.walk(os.path.join(tests.ROOT, 'tff_gma')):
    for name in files:
      if name.endswith('.py'):
        with open(os.path.join(folder, name)) as f:
          tree = ast.parse(f.read())
        for node in ast.walk(tree):
          if isinstance(node, ast.Import):
            names.update(alias.name.split('.')[0] for alias in node.names)
          elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split('.')[0])
  return names


def _declared_requirements() -> set[str]:
  """The distribution names in setup.py's install_requires."""
  with open(os.path.join(tests.ROOT, 'setup.py')) as f:
    tree = ast.parse(f.read())
  (requirements,) = [k.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                     for k in node.keywords if k.arg == 'install_requires']
  return {re.split(r'[<>=~!]', ast.literal_eval(e))[0] for e in requirements.elts}


def test_setup_declares_every_third_party_package_the_library_imports():
  third_party = {n for n in _library_imports() if n not in sys.stdlib_module_names and n != 'tff_gma'}
  unknown = third_party - set(_DISTRIBUTIONS)
  assert not unknown, f'tff_gma imports {sorted(unknown)}: add them to setup.py and to _DISTRIBUTIONS here'
  assert {_DISTRIBUTIONS[n] for n in third_party} <= _declared_requirements()
  assert 'training' not in _library_imports() and 'matplotlib' not in _library_imports()


def test_importing_the_library_brings_in_no_harness_and_no_plotting():
  # TFF itself imports scikit-learn (tensorflow_privacy's logistic regression), so what matters is what the
  # library adds to `import tensorflow_federated`.
  code = ('import sys; import tensorflow_federated; before = set(sys.modules); '
          'import tff_gma.aggregators, tff_gma.learning, tff_gma.audit; '
          'added = sorted(m for m in set(sys.modules) - before '
          'if m.split(".")[0] in ("training", "matplotlib", "sklearn")); print("ADDED", added)')
  process = subprocess.run([sys.executable, '-c', code], cwd=tests.ROOT, capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  assert process.returncode == 0, process.stderr[-2000:]
  assert 'ADDED []' in process.stdout, process.stdout


@pytest.mark.slow
def test_the_wheel_holds_exactly_one_top_level_package(tmp_path):
  process = subprocess.run(
      [sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q', '-w', str(tmp_path),
       tests.ROOT], capture_output=True, text=True, timeout=600)
  assert process.returncode == 0, process.stderr[-2000:]
  (wheel,) = [p for p in tmp_path.iterdir() if p.suffix == '.whl']
  with zipfile.ZipFile(wheel) as archive:
    top_level = {name.split('/')[0] for name in archive.namelist()}
  assert {t for t in top_level if not t.endswith('.dist-info')} == {'tff_gma'}


# ----------------------------------------------------------------------------------------------------------------
# scripts/setup.sh: arguments, the --gpu pins, the idempotence stamp (dry runs: nothing is installed).

_SETUP = os.path.join(tests.ROOT, 'scripts', 'setup.sh')


def _setup(tmp_path, *args, stamp=None):
  """Runs setup.sh as a dry run against a venv directory in tmp_path whose python is this venv's."""
  venv = tmp_path / 'venv'
  (venv / 'bin').mkdir(parents=True, exist_ok=True)
  python = venv / 'bin' / 'python'
  python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
  python.chmod(0o755)
  if stamp is not None:
    (venv / '.tff_gma_setup_stamp').write_text(stamp + '\n')
  process = subprocess.run(['bash', _SETUP, *args], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, TFF_GMA_SETUP_DRY_RUN='1', TFF_GMA_SETUP_VENV=str(venv)))
  return process, process.stdout + process.stderr


def _files_hash() -> str:
  data = b''.join(open(os.path.join(tests.ROOT, name), 'rb').read()
                  for name in ('requirements.txt', 'setup.py', 'scripts/setup.sh'))
  return hashlib.sha256(data).hexdigest()


def _would_run(output: str) -> list[str]:
  return [line for line in output.splitlines() if line.startswith('setup.sh: would run:')]


def test_setup_gpu_installs_tensorflows_and_cuda_pins_into_the_venv(tmp_path):
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  process, output = _setup(tmp_path, '--gpu', '--force')
  assert process.returncode == 0, output
  (gpu_line,) = [line for line in _would_run(output) if 'nvidia-' in line]
  assert f'{tmp_path}/venv/bin/python -m pip' in gpu_line and ' install --no-deps ' in gpu_line
  pins = set(re.findall(r'(nvidia-[\w-]+==[\d.]+)', gpu_line))
  # The installed TensorFlow's own `and-cuda` extra, without its tensorrt pin.
  declared = {re.sub(r'\s*\((==[\d.]+)\)', r'\1', r.split(';')[0]).strip()
              for r in importlib.metadata.requires('tensorflow') if "extra == 'and-cuda'" in r}
  assert importlib.metadata.version('tensorflow') == '2.14.1'
  assert pins == {d for d in declared if not d.startswith('tensorrt')} and len(pins) == 10
  assert not (tmp_path / 'venv' / '.tff_gma_setup_stamp').exists()  # A dry run writes no stamp.
  plain, output = _setup(tmp_path, '--force')
  assert plain.returncode == 0 and _would_run(output) and not any('nvidia-' in line for line in _would_run(output))


def test_setup_stamp_records_the_gpu_install(tmp_path):
  files = _files_hash()
  # Up to date: nothing to do (a GPU install also serves a plain run).
  for stamp, args in ((files, ()), (f'{files} gpu', ()), (f'{files} gpu', ('--gpu',))):
    process, output = _setup(tmp_path, *args, stamp=stamp)
    assert process.returncode == 0 and not _would_run(output), (stamp, args, output)
  # A plain install asked for --gpu: installs (the GPU libraries included).
  process, output = _setup(tmp_path, '--gpu', stamp=files)
  assert process.returncode == 0 and any('nvidia-cudnn-cu11==8.7.0.84' in line for line in _would_run(output))
  # Changed files: reinstall.
  process, output = _setup(tmp_path, stamp='0' * 64 + ' gpu')
  assert process.returncode == 0 and _would_run(output)


def test_setup_refuses_an_unknown_argument(tmp_path):
  process, output = _setup(tmp_path, '--gpus')
  assert process.returncode == 2 and "unknown argument '--gpus'" in output and not _would_run(output)


def test_setup_data_installs_fashion_mnist_from_debian_or_says_how(tmp_path):
  process, output = _setup(tmp_path, '--data=cifar10', stamp=_files_hash())
  assert process.returncode == 2 and "unknown data set 'cifar10'" in output
  process, output = _setup(tmp_path, '--data=fashion_mnist', stamp=_files_hash())
  installed = os.path.isfile('/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz')
  if installed:  # Nothing to do: the venv is up to date and the files are there.
    assert process.returncode == 0 and 'dataset-fashion-mnist' not in output, output
  elif os.geteuid() == 0:
    assert process.returncode == 0 and 'apt-get install -y -qq dataset-fashion-mnist' in output, output
  else:
    assert process.returncode == 1 and 'as root, run: apt-get update && apt-get install -y dataset-fashion-mnist' \
        in output


# ----------------------------------------------------------------------------------------------------------------
# The Python range: setup.py's python_requires, the README's "Needs **Python ...**", setup.sh's interpreter, and
# the Requires-Python of every pinned release say the same; the README's library route installs.

_README = os.path.join(tests.ROOT, 'README.md')
_ROUTE_MARK = 'To use the library in your own environment'


def _setup_keywords() -> dict[str, ast.AST]:
  with open(os.path.join(tests.ROOT, 'setup.py')) as f:
    tree = ast.parse(f.read())
  (call,) = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, 'attr', None) == 'setup']
  return {k.arg: k.value for k in call.keywords}


def _python_requires() -> SpecifierSet:
  return SpecifierSet(ast.literal_eval(_setup_keywords()['python_requires']))


def _minors(spec: SpecifierSet) -> list[str]:
  """The Python 3 minor versions (`3.N`) a specifier admits, by their first and last bugfix release."""
  return [f'3.{m}' for m in range(0, 40) if spec.contains(f'3.{m}.0') and spec.contains(f'3.{m}.99')]


def _readme() -> str:
  with open(_README, encoding='utf-8') as f:
    return f.read()


def _readme_minors() -> list[str]:
  (first, last), = re.findall(r'Needs \*\*Python (3\.\d+)(?:-(3\.\d+))?\*\*', _readme())
  low, high = int(first.split('.')[1]), int((last or first).split('.')[1])
  return [f'3.{m}' for m in range(low, high + 1)]


def _pins() -> dict[str, str]:
  """requirements.txt's `name==version` lines."""
  pins = {}
  with open(os.path.join(tests.ROOT, 'requirements.txt')) as f:
    for line in f:
      line = line.split('#')[0].strip()
      if line:
        name, version = re.fullmatch(r'([A-Za-z0-9_.-]+)==([\w.]+)', line).groups()
        pins[name] = version
  return pins


def test_setup_readme_setup_sh_and_the_pins_state_one_python_range():
  spec = _python_requires()
  minors = _minors(spec)
  assert minors == _readme_minors(), (str(spec), _readme_minors())
  assert f'{sys.version_info.major}.{sys.version_info.minor}' in minors  # The suite runs inside the claim.
  with open(_SETUP) as f:
    setup_sh = f.read()
  (wanted,) = re.findall(r"sys\.version_info\[:2\] != \((\d+), (\d+)\)", setup_sh)
  assert ['.'.join(wanted)] == minors
  # Every pinned release (and TFF itself) admits every Python of the range: the installed venv holds the pins, and
  # its distributions' metadata say what each needs.
  refusing = {}
  for name, version in {**_pins(), 'tensorflow-federated': '0.87.0'}.items():
    assert importlib.metadata.version(name) == version, f'{name}: the venv holds another version than the pin'
    requires = importlib.metadata.metadata(name)['Requires-Python']
    if requires and not all(SpecifierSet(requires).contains(f'{m}.0') for m in minors):
      refusing[f'{name}=={version}'] = requires
  assert not refusing, f'pins that do not install on every Python of {spec}: {refusing}'


def test_package_metadata_describes_the_package_without_inventing_a_license_or_url():
  keywords = _setup_keywords()
  description = ast.literal_eval(keywords['description'])
  assert 'TensorFlow Federated' in description and len(description) < 200
  assert ast.unparse(keywords['long_description']) == "open('README.md', encoding='utf-8').read()"
  assert ast.literal_eval(keywords['long_description_content_type']) == 'text/markdown'
  has_license_file = any(os.path.exists(os.path.join(tests.ROOT, n)) for n in ('LICENSE', 'LICENSE.txt', 'COPYING'))
  assert ('license' in keywords) == has_license_file  # No LICENSE file: no license claimed.
  assert 'url' not in keywords  # The project has no public home yet.
  classifiers = ast.literal_eval(keywords['classifiers'])
  assert [c.rpartition(':: ')[2] for c in classifiers if re.fullmatch(r'.*Python :: 3\.\d+', c)] == _minors(
      _python_requires())


def _route() -> list[str]:
  """The README's commands for a library user: the bash block after its 'To use the library...' line."""
  after = _readme().split(_ROUTE_MARK, 1)[1]
  block = re.search(r'```bash\n(.*?)```', after, re.S).group(1)
  return [line.split('#')[0].strip() for line in block.splitlines() if line.split('#')[0].strip()]


def test_the_readme_route_is_setup_shs_and_installs_the_pinned_tff():
  route = _route()
  tff_pin = [r for r in (ast.literal_eval(e) for e in _setup_keywords()['install_requires'].elts)
             if r.startswith('tensorflow-federated')]
  assert route == [f'python{_minors(_python_requires())[-1]} -m venv .venv && . .venv/bin/activate',
                   'pip install -r requirements.txt',
                   f'pip install --no-deps {tff_pin[0]}',
                   'pip install --no-deps .']
  with open(_SETUP) as f:
    setup_sh = f.read()
  for step in ('install -r requirements.txt', f'install --no-deps {tff_pin[0]}', 'install --no-deps'):
    assert step in setup_sh


_ROUTE_CHECK = '''
import importlib.metadata
import numpy as np
import tensorflow_federated as tff
import tff_gma.aggregators
import tff_gma.runtime
tff_gma.runtime.set_simulation_context()
try:
  process = tff_gma.aggregators.GradientMaskedFactory(tau=0.4).create(
      tff.TensorType(np.float32, [3]), tff.TensorType(np.float32))
  values = [np.array([1., -1., 2.], np.float32), np.array([3., -1., 2.], np.float32)]
  output = process.next(process.initialize(), values, [1.0, 1.0])
  print('RESULT', [float(x) for x in output.result])
finally:
  tff_gma.runtime.shutdown()
metadata = importlib.metadata.metadata('tff-gma')
print('FILE', tff_gma.__file__)
print('REQUIRES_PYTHON', metadata['Requires-Python'])
'''


@pytest.mark.slow
def test_the_readme_route_installs_the_library_into_a_fresh_venv(tmp_path):
  """The README's four lines, verbatim, in a fresh directory holding what a checkout gives `pip install .`; then
  the installed library (not the checkout's) runs GMA in TFF, and `pip check` finds only TFF's jax pins unmet.

  Slow tier, run once per CI run: measured 124 s for the four lines and 165 s for the whole test on this project's
  2-core machine under load, downloading everything (pip's HTTP cache stayed empty here; where pip caches, a rerun
  reuses ~/.cache/pip). The new venv is removed at the end."""
  checkout = tmp_path / 'checkout'
  checkout.mkdir()
  # pyproject.toml too: its presence alone makes pip build through PEP 517 (the route a user's checkout takes).
  for name in ('setup.py', 'pyproject.toml', 'README.md', 'requirements.txt'):
    shutil.copy(os.path.join(tests.ROOT, name), checkout / name)
  shutil.copytree(os.path.join(tests.ROOT, 'tff_gma'), checkout / 'tff_gma',
                  ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
  python = f'python{_minors(_python_requires())[-1]}'
  bin_dir = tmp_path / 'bin'  # The README's `python3.11`: this suite's own interpreter, outside its venv.
  bin_dir.mkdir()
  os.symlink(sys._base_executable, bin_dir / python)  # pylint: disable=protected-access
  env = {k: v for k, v in os.environ.items() if k not in ('VIRTUAL_ENV', 'PYTHONPATH', 'PYTHONHOME')}
  env.update(PATH=f'{bin_dir}:/usr/bin:/bin', PIP_DISABLE_PIP_VERSION_CHECK='1', TF_CPP_MIN_LOG_LEVEL='3')
  began = time.monotonic()
  try:
    install = subprocess.run(['bash', '-c', '\n'.join(['set -euo pipefail', *_route()])], cwd=checkout, env=env,
                             capture_output=True, text=True, timeout=1500, stdin=subprocess.DEVNULL)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    seconds = time.monotonic() - began
    venv_python = str(checkout / '.venv' / 'bin' / 'python')
    check = subprocess.run([venv_python, '-m', 'pip', 'check'], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    assert sorted(check.stdout.splitlines()) == [
        'tensorflow-federated 0.87.0 has requirement jax==0.4.14, but you have jax 0.4.13.',
        'tensorflow-federated 0.87.0 has requirement jaxlib==0.4.14, but you have jaxlib 0.4.13.'], check.stdout
    (tmp_path / 'check.py').write_text(_ROUTE_CHECK)
    run = subprocess.run([venv_python, 'check.py'], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-3000:]
    assert 'RESULT [2.0, -1.0, 2.0]' in run.stdout, run.stdout  # Full agreement: GMA is the weighted mean.
    site = str(checkout / '.venv' / 'lib')
    assert re.search(rf'^FILE {re.escape(site)}/python3\.\d+/site-packages/tff_gma/__init__\.py$', run.stdout, re.M)
    (requires,) = re.findall(r'^REQUIRES_PYTHON (.*)$', run.stdout, re.M)
    assert SpecifierSet(requires) == _python_requires()
    print(f'README route: installed in {seconds:.0f} s')
  finally:
    shutil.rmtree(checkout / '.venv', ignore_errors=True)  # Gigabytes: not kept among pytest's last temp dirs.
