"""tff-gma: Gradient Masked Averaging, RFA and Elastic aggregation for TensorFlow Federated.

Install with `scripts/setup.sh`, or as README "Install" says for your own environment: `pip install -r
requirements.txt`, `pip install --no-deps tensorflow-federated==0.87.0`, then `pip install --no-deps .`
(tests/setup_test.py runs exactly those lines in a fresh venv). A plain `pip install .` cannot resolve
tensorflow-federated 0.87.0, whose jax/jaxlib==0.4.14 pins the registry does not serve.

Python 3.11 only: TFF 0.87.0 itself allows 3.9-3.11, but the pinned set in requirements.txt (the one the tests
run on) has releases that need Python >= 3.11 (contourpy 1.3.3, pillow 13.0.0, etils 1.15.0, python-dateutil
4.0.0, ...), and below 3.11 tensorflow-metadata 1.15.0 needs protobuf < 4.21 where 3.11 takes 4.25: another set,
which nothing here tests. tests/setup_test.py checks that this range, the README's and every pin's own
Requires-Python agree.

No license is declared: the project has no LICENSE file yet, and none is assumed here.
"""

import setuptools

setuptools.setup(
    name='tff-gma',
    version='0.1.0',
    description=(
        'Aggregation beyond averaging for TensorFlow Federated: gradient masked averaging (GMA, FedGMA), '
        'robust federated aggregation (RFA) and elastic aggregation, built from secure aggregates.'
    ),
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    keywords=['federated learning', 'tensorflow federated', 'robust aggregation', 'secure aggregation'],
    classifiers=[
        'Programming Language :: Python :: 3',
        'Programming Language :: Python :: 3 :: Only',
        'Programming Language :: Python :: 3.11',
        'Intended Audience :: Science/Research',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
    # The library only: the experiment harness (`training/`, studies, demo, benchmark) runs from the checkout.
    packages=setuptools.find_packages(include=['tff_gma', 'tff_gma.*']),
    python_requires='>=3.11,<3.12',  # README "Install"; see the docstring above.
    # Every third-party package `tff_gma` imports (tests/setup_test.py checks this list against the source).
    install_requires=[
        'absl-py>=1.0',
        'grpcio~=1.46',  # The runtime's channels to TFF workers.
        'numpy~=1.25',
        'portpicker~=1.6',  # The runtime's worker ports.
        # load_digits is the embedded offline data set; scikit-learn is already pulled in by
        # tensorflow-privacy (a TFF dependency), declared here because tff_gma.data imports it directly.
        'scikit-learn',
        'tensorflow~=2.14.0',
        'tensorflow-datasets>=4.9,<4.10',
        'tensorflow-federated==0.87.0',
    ],
    extras_require={'test': ['pytest']},
)
