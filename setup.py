"""Build hook for the optional C speedups; all metadata lives in pyproject.toml."""

from setuptools import Extension, setup

# optional=True: a machine without a C compiler still installs kvtier and uses the
# pure-Python fallbacks (kvtier/keys.py, kvtier/alloc/buddy.py, ...). Two modules so the
# store's native core (_core) and the transfer helpers (_speedups) build and change apart.
setup(
    ext_modules=[
        Extension("kvtier._speedups", ["kvtier/_speedups.c"], optional=True),
        Extension("kvtier._core", ["kvtier/_core.c", "kvtier/_core_index.c"], optional=True),
    ]
)
