"""The compiled parts of gdskv: the native page engine (``gdskv.native._pages``) and the data
path's yielding lock (``gdskv.native._locks``).

Everything else is in pyproject.toml. The extensions are plain C on the CPython limited API, so
``pip install`` needs only a C compiler and the Python headers, and a wheel built on CPython
3.11 (``python -m build``) is one abi3 wheel for every later CPython. CPython 3.10's limited API
lacks the buffer protocol: there it is built against the full API. Without a compiler the
install fails; gdskv without the extensions (a source checkout on ``sys.path``) runs the Python
path (``gdskv.native``) and plain ``threading.Lock``s.
"""

import sys

from setuptools import Extension, setup

LIMITED = sys.version_info >= (3, 11)


def native(name: str, *more: str) -> Extension:
    """Extension ``name`` from ``name.c`` and the C files ``more`` (sharing engine.h)."""
    return Extension(
        f"gdskv.native.{name}", [f"gdskv/native/{c}.c" for c in (name, *more)],
        depends=["gdskv/native/engine.h"] if more else [],
        py_limited_api=LIMITED,
        define_macros=[("Py_LIMITED_API", "0x030B0000")] if LIMITED else [],
        extra_compile_args=["-O3", "-fvisibility=hidden"],
    )


setup(
    # the page engine with the quick reader over it (gdskv/quick_calls.py), the slot
    # trailers' encoder (gdskv/slot_trailer.py) and the journal records' (gdskv/journal.py),
    # and the data path's yielding lock
    # (gdskv/yielding_lock.py)
    ext_modules=[native("_pages", "quick_read", "trailer", "records"), native("_locks")],
    options={"bdist_wheel": {"py_limited_api": "cp311"}} if LIMITED else {},
)
