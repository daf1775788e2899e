"""Build the optional native kernel; everything else is declared in pyproject.toml.

`trainermon.stats._fused` (one-pass CPU statistics) is optional: when it cannot be compiled (no C compiler),
the install still succeeds and the engine uses its eager-torch path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "trainermon.stats._fused",
            sources=["trainermon/stats/_fused.c"],
            extra_compile_args=["-O3", "-std=c11"],
            optional=True,
        )
    ]
)
