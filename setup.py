"""Pure-Python install of the attention package; GPU libraries are extras."""

from setuptools import find_packages, setup

from build_tools.utils import OPTIONAL_DEPENDENCIES, read_version

setup(
    name="te-attention",
    version=read_version(),
    description="Independent implementation of TransformerEngine's PyTorch attention API",
    packages=find_packages(include=["transformer_engine", "transformer_engine.*", "transformer_engine_torch"]),
    python_requires=">=3.9",
    # A floor only: never force a torch build on users who already have a CUDA one.
    install_requires=["torch>=2.4"],
    extras_require=OPTIONAL_DEPENDENCIES,
    entry_points={
        "console_scripts": [
            "te-attention-backend=transformer_engine.pytorch.attention.dot_product_attention.selection.explain:main",
        ]
    },
)
