"""Install comm_codec. Metadata lives in setup.cfg; this maps the shipped codebooks.

The top-level ``codebooks/`` folder (books + how they were made) is installed as the
data package ``comm_codec._books`` so that ``CodebookSet.default()`` finds it in both
regular and editable installs.
"""

from setuptools import find_packages, setup

setup(
    package_dir={"comm_codec._books": "codebooks"},
    packages=find_packages(include=["comm_codec", "comm_codec.*"]) + ["comm_codec._books"],
    package_data={"comm_codec._books": ["*.json", "README.md"], "comm_codec": ["*/*.md"]},
)
