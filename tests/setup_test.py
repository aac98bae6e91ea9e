"""The installable package: exactly `tff_gma`, every third-party import declared, no harness behind the library."""

import ast
import hashlib
import os
import re
import subprocess
import sys
import zipfile

import pytest

import tests

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
  assert plain.returncode == 0 and _would_run(output) and not any('nvidia-' in l for l in _would_run(output))


def test_setup_stamp_records_the_gpu_install(tmp_path):
  files = _files_hash()
  # Up to date: nothing to do (a GPU install also serves a plain run).
  for stamp, args in ((files, ()), (f'{files} gpu', ()), (f'{files} gpu', ('--gpu',))):
    process, output = _setup(tmp_path, *args, stamp=stamp)
    assert process.returncode == 0 and not _would_run(output), (stamp, args, output)
  # A plain install asked for --gpu: installs (the GPU libraries included).
  process, output = _setup(tmp_path, '--gpu', stamp=files)
  assert process.returncode == 0 and any('nvidia-cudnn-cu11==8.7.0.84' in l for l in _would_run(output))
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
