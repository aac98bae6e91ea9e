"""tff-gma: Gradient Masked Averaging, RFA and Elastic aggregation for TensorFlow Federated.

Install with `scripts/setup.sh` (pinned set in `requirements.txt`); a plain `pip install .` cannot resolve
tensorflow-federated 0.87.0 here because the registry serves no jaxlib==0.4.14 (see README "Install").
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
    # The library only: the experiment harness (`training/`, studies, demo, benchmark) runs from the checkout.
    packages=setuptools.find_packages(include=['tff_gma', 'tff_gma.*']),
    python_requires='>=3.9,<3.12',
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
