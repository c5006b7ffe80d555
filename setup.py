"""Build hook for the optional C speedups; all metadata lives in pyproject.toml."""

from setuptools import Extension, setup

# optional=True: a machine without a C compiler still installs kvtier and uses the
# pure-Python fallback in kvtier/keys.py.
setup(ext_modules=[Extension("kvtier._speedups", ["kvtier/_speedups.c"], optional=True)])
