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
    packages=setuptools.find_packages(include=['tff_gma', 'tff_gma.*', 'training', 'training.*']),
    python_requires='>=3.9,<3.12',
    install_requires=[
        'tensorflow~=2.14.0',
        'tensorflow-federated==0.87.0',
        'tensorflow-datasets>=4.9,<4.10',
        'numpy~=1.25',
        'absl-py>=1.0',
        # load_digits is the embedded offline data set; scikit-learn is already pulled in by
        # tensorflow-privacy (a TFF dependency), declared here because tff_gma imports it directly.
        'scikit-learn',
    ],
    extras_require={'test': ['pytest']},
)
