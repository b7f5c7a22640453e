"""Install mpidl.

``kernels/`` sits at the top of the source tree but installs as ``mpidl.kernels``, so it
never shadows someone else's top-level ``kernels`` package.
"""
from setuptools import find_packages, setup

packages = find_packages(include=["mpidl", "mpidl.*"])
kernel_packages = ["mpidl.kernels"] + [
    "mpidl.kernels." + p for p in find_packages(where="kernels")
]

setup(
    name="mpidl",
    version="0.1.0",
    description="Pure-MPI distributed training of neural networks on NumPy and CuPy",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=packages + kernel_packages,
    package_dir={"mpidl.kernels": "kernels"},
    package_data={"mpidl.kernels": ["*.cu", "cuda/*.cu"]},
    install_requires=[
        "numpy>=1.22",
        "mpi4py>=3.1",
        "numba>=0.57",
        "tqdm>=4.0",
        'tomli>=1.1; python_version < "3.11"',
    ],
    extras_require={
        "mpich": ["mpich"],
        "gpu": ["cupy-cuda12x"],
        "plot": ["matplotlib"],
        # mpidl rl: the environments (CartPole..., MinAtar), scipy for the replay's
        # chi-squared test
        "rl": ["gymnasium>=0.29", "minatar", "scipy"],
        "test": ["pytest>=7", "pytest-timeout", "scikit-learn", "matplotlib"],
    },
    entry_points={"console_scripts": ["mpidl=mpidl.cli.main:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)
