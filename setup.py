"""Builds kvray's two C helpers (the batched memcpy with the hand-off's native lane, and the
planner's per-op loops); everything else lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvray._copy_pool",
            sources=["kvray/_copy_pool.c", "kvray/_lane.c"],
            depends=["kvray/_placement.h", "kvray/_copy_job.h"],  # _lane.c includes both
            extra_compile_args=["-O2"],
        ),
        Extension(
            "kvray._plan",
            sources=["kvray/_plan.c"],
            depends=["kvray/_placement.h"],
            extra_compile_args=["-O2", "-Wall"],
        ),
    ]
)
