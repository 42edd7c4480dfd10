"""Builds the native row kernels and lists the packages; the rest of the metadata is in pyproject.toml.

The extension is optional: when it cannot be compiled (no C compiler, no Python headers), the
install still succeeds and cxltrain.kernels falls back to its torch kernels with one warning.
"""

from setuptools import Extension, find_packages, setup

# emulation/ and kernels/ are top-level folders of the repository installed inside the cxltrain
# namespace (a top-level import name `kernels` collides with a PyPI package). Every package under
# the three folders is found here, so a new one cannot be left out of a normal install.
HOMES = {"cxltrain": "cxltrain", "cxltrain.emulation": "emulation", "cxltrain.kernels": "kernels"}
PACKAGES = [name for prefix, folder in HOMES.items()
            for name in [prefix, *(f"{prefix}.{sub}" for sub in find_packages(folder))]]

setup(
    packages=PACKAGES,
    package_dir=HOMES,
    # CUDA sources (and their headers) are read at run time, where CuPy compiles them.
    package_data={"": ["*.cu", "*.cuh", "*.h"]},
    ext_modules=[
        Extension(
            "cxltrain.kernels._rows",
            sources=["kernels/rows.c", "kernels/lookups.c", "kernels/persist.c", "kernels/undo.c", "kernels/crc32.c"],
            depends=["kernels/persist.h", "kernels/undo.h", "kernels/crc32.h", "kernels/rowset.h", "kernels/lookups.h"],
            # -ffp-contract=off: no implicit FMA, so float results do not depend on the compiler's
            # choices; the kernels use explicit fmaf where they want one rounding.
            # -flto: the sources share small hot functions (persist.c, crc32.c) that were one file's before
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11", "-flto"],
            extra_link_args=["-O3", "-flto"],
            optional=True,
        ),
        # The Criteo line parser (cxltrain/data/lines.py falls back to Python without it).
        Extension(
            "cxltrain.kernels._criteo",
            sources=["kernels/criteo.c"],
            extra_compile_args=["-O3", "-std=gnu11"],
            optional=True,
        ),
    ],
)
