"""Build the optional native parts; everything else is declared in pyproject.toml.

Both are optional: when one cannot be compiled (no C compiler), the install still succeeds and its Python
twin is used. `trainermon.stats._fused`: one-pass CPU statistics (else the engine's eager-torch path).
`trainermon.exporters._csvtext`: the CSV exporter's lines, built without the GIL (else in Python).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "trainermon.stats._fused",
            sources=["trainermon/stats/_fused.c"],
            extra_compile_args=["-O3", "-std=c11"],
            optional=True,
        ),
        Extension(
            "trainermon.exporters._csvtext",
            sources=["exporters/_csvtext.c"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        ),
    ]
)
