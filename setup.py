"""The native page engine (``gdskv.native._pages``): the one compiled part of gdskv.

Everything else is in pyproject.toml. The extension is plain C on the CPython limited API, so
``pip install`` needs only a C compiler and the Python headers, and a wheel built on CPython
3.11 (``python -m build``) is one abi3 wheel for every later CPython. CPython 3.10's limited API
lacks the buffer protocol: there it is built against the full API. Without a compiler the
install fails; gdskv without the extension (a source checkout on ``sys.path``) runs the Python
path (``gdskv.native``).
"""

import sys

from setuptools import Extension, setup

LIMITED = sys.version_info >= (3, 11)

setup(
    ext_modules=[Extension(
        "gdskv.native._pages", ["gdskv/native/_pages.c"],
        py_limited_api=LIMITED,
        define_macros=[("Py_LIMITED_API", "0x030B0000")] if LIMITED else [],
        extra_compile_args=["-O3", "-fvisibility=hidden"],
    )],
    options={"bdist_wheel": {"py_limited_api": "cp311"}} if LIMITED else {},
)
