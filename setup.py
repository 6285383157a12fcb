"""Builds kvray's one C helper (batched memcpy); everything else lives in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvray._copy", sources=["kvray/_copy.c"], extra_compile_args=["-O2"])])
