"""Run a script against a chosen gdskv tree: ab.py <before|after> [slice=N] script args..."""
import os, sys, runpy
which = sys.argv[1]; args = sys.argv[2:]
if which == "before":
    sys.meta_path = [m for m in sys.meta_path if "editable" not in repr(m).lower()]
    sys.path.insert(0, os.path.abspath(".before"))
slice_bytes = None
if args and args[0].startswith("slice="):
    slice_bytes = int(args[0].split("=")[1]); args = args[1:]
import gdskv, gdskv.backends.posix as posix
if slice_bytes:
    posix.READ_SLICE_BYTES = slice_bytes
print(f"# {which} gdskv from {os.path.dirname(gdskv.__file__)} slice={getattr(posix, 'READ_SLICE_BYTES', None)}", file=sys.stderr, flush=True)
sys.argv = args
sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
runpy.run_path(args[0], run_name="__main__")
