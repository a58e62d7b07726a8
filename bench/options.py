"""Job options, named as fio names them, from the command line or from fio-style INI job files.

One table (:data:`JOB_OPTIONS`) drives both argparse and the job-file reader, so a value is
checked the same way wherever it comes from, and every error names the option and the value.

Job files follow fio: ``[global]`` plus one section per job, ``key=value`` or a bare ``key``
for a boolean, ``${VAR}`` replaced from the environment, ``#``/``;`` comments. Options given on
the command line next to job files override the files' values (so ``--directory=...`` points a
shared job file at a disk); both override the ``GDSKV_*`` environment (fio's order: command line,
job file, environment). Jobs always run one after the other, each its own reporting group
(fio's ``stonewall`` on every job).

Sizes follow fio, ``kb_base`` included: with fio's default ``kb_base=1024``, ``k``/``KB``/``M``/
``MB`` are powers of 1024 and ``KiB``/``MiB`` powers of 1000 (fio's compatibility rule); with
``kb_base=1000`` the other way round.
"""

from __future__ import annotations

import argparse
import configparser
import dataclasses
import enum
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gdskv.cli import int_between
from gdskv.config import ENV_PREFIX, FIELD_DOCS, TierConfig, suggest
from gdskv.layout import canonical_dtype_name

from .measurements import fmt_size_exact
from .presets import PRESETS

RW_MODES = ("read", "write", "randread", "randwrite", "rw", "readwrite", "randrw")
ENGINES = ("gdskv", "raw", "hicachefile")
OUTPUT_FORMATS = ("normal", "json", "terse")


class OptionError(ValueError):
    """A bad option value; the CLI prints it argparse-style and exits with status 2."""


# -- value parsers (each raises OptionError with a short reason) ------------------------------

KB_BASES = (1024, 1000)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(i?)b?)?\s*$", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def fio_size(text: str, kb_base: int = 1024) -> int:
    """A size as fio reads it: ``4096``, ``64k``, ``16M``, ``1.5G``, ``4KiB``. With fio's default
    ``kb_base=1024``, k/K/KB = 1024 and KiB = 1000 (fio inverts IEC and SI for compatibility);
    with ``kb_base=1000``, k/KB = 1000 and KiB = 1024."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise OptionError(f"bad size {text!r} (examples: 4096, 64k, 16M, 1G)")
    number, unit, iec = m.groups()
    base = kb_base
    if iec:
        base = 1000 if kb_base == 1024 else 1024
    value = float(number) * (base ** _POWERS[unit.lower()] if unit else 1)
    if value != int(value):
        raise OptionError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def decimal_unit(text: str, kb_base: int = 1024) -> str:
    """Why a size is not what its unit suggests: ``MiB = 1000^2 with kb_base=1024, as fio``
    for a unit that counts in powers of 1000 here, else ``""``."""
    m = _SIZE_RE.match(str(text))
    if not m or not m.group(2):
        return ""
    unit, iec = m.group(2), m.group(3)
    base = (1000 if kb_base == 1024 else 1024) if iec else kb_base
    if base != 1000:
        return ""
    written = str(text).strip().lstrip("0123456789.").strip()
    return f"{written} = 1000^{_POWERS[unit.lower()]} with kb_base={kb_base}, as fio"


def size_text(given: str | None, nbytes: int, kb_base: int = 1024) -> str:
    """A size as given and, where that differs, what it came to: ``64MiB (64000000 bytes:
    MiB = 1000^2 with kb_base=1024, as fio)``, ``100M (100MiB)``, ``32MiB``."""
    exact = fmt_size_exact(nbytes)
    if given is None or given.strip() == exact:
        return exact
    why = decimal_unit(given, kb_base)
    return f"{given.strip()} ({f'{nbytes} bytes: {why}' if why else exact})"


def _positive_size(text: str, kb_base: int = 1024) -> int:
    n = fio_size(text, kb_base)
    if n <= 0:
        raise OptionError(f"must be > 0, got {text!r}")
    return n


def _kb_base(text: str) -> int:
    try:
        n = int(str(text).strip())
    except ValueError:
        n = None
    if n not in KB_BASES:
        raise OptionError(f"expected 1024 (fio's default: k and KB = 1024, KiB = 1000) or 1000 "
                          f"(k and KB = 1000, KiB = 1024), got {text!r}")
    return n


#: fio's ``verify`` methods. gdskv-bench compares every restored byte with what was written,
#: which catches whatever these checksums would; the tier verifies its own page checksums
#: (CRC-32C, or the GPU hash) on every read besides. ``null`` is fio's "pretend to verify".
FIO_VERIFY = ("md5", "crc64", "crc32", "crc32c", "crc32c-intel", "crc16", "crc7", "sha1",
              "sha256", "sha512", "sha3-224", "sha3-256", "sha3-384", "sha3-512", "xxhash",
              "meta", "pattern")


_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def _bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in _TRUE_WORDS:
        return True
    if t in _FALSE_WORDS:
        return False
    raise OptionError(f"expected a boolean (1/0, true/false), got {text!r}")


def _verify(text: str) -> bool:
    t = str(text).strip().lower()
    if t in FIO_VERIFY:
        return True
    if t in ("null", "none"):
        return False
    try:
        return _bool(t)
    except OptionError:
        raise OptionError(f"expected one of fio's verify methods (crc32c, md5, sha256, xxhash, "
                          f"...: each compares every byte here), 1 or 0, got {text!r}") from None


def _int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            n = int(str(text).strip(), 0)
        except ValueError:
            raise OptionError(f"expected an integer, got {text!r}") from None
        if n < lo or (hi is not None and n > hi):
            raise OptionError(f"must be in [{lo}, {hi if hi is not None else 'inf'}], got {n}")
        return n
    return parse


def _positive_float(text: str) -> float:
    try:
        x = float(str(text).strip())
    except ValueError:
        raise OptionError(f"expected a number, got {text!r}") from None
    if not x > 0:
        raise OptionError(f"must be > 0, got {text!r}")
    return x


_TIME_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|m|h|d)?\s*$", re.IGNORECASE)
_TIME_UNITS = {None: 1.0, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _time(text: str) -> float:
    """fio time: seconds by default, or with a unit (``500ms``, ``2m``). Returns seconds."""
    m = _TIME_RE.match(str(text))
    if not m:
        raise OptionError(f"bad time {text!r} (examples: 10, 10s, 500ms, 2m)")
    unit = m.group(2).lower() if m.group(2) else None
    return float(m.group(1)) * _TIME_UNITS[unit]


def _choice(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        t = str(text).strip().lower()
        if t not in choices:
            raise OptionError(f"{text!r} is not one of {', '.join(choices)}")
        return t
    return parse


def _dtype(text: str) -> str:
    try:
        return canonical_dtype_name(str(text))
    except ValueError as exc:
        raise OptionError(str(exc)) from None


def _model(text: str) -> str:
    t = str(text).strip().lower()
    if t not in PRESETS:
        raise OptionError(f"unknown model {text!r}; presets: {', '.join(PRESETS)}")
    return t


def _name(text: str) -> str:
    t = str(text).strip()
    if not t or any(c in t for c in "/\\;\n"):
        raise OptionError(f"job name must be non-empty without '/', '\\\\' or ';', got {text!r}")
    return t


def _str(text: str) -> str:
    return str(text)


# -- the option table -------------------------------------------------------------------------

@dataclass(frozen=True)
class Opt:
    name: str                       # fio spelling; job-file key (``-`` and ``_`` both accepted)
    parse: Callable[[str], Any]
    default: Any
    help: str
    flag: bool = False              # boolean: a bare ``--opt`` / bare key means 1
    aliases: tuple[str, ...] = ()


JOB_OPTIONS: tuple[Opt, ...] = (
    Opt("name", _name, "gdskv", "job name"),
    Opt("description", _str, "", "free text, shown in the report"),
    Opt("rw", _choice(RW_MODES), "write",
        "read|write|randread|randwrite|rw|randrw. read jobs lay out their pages first "
        "(untimed), as fio lays out its file; rw/randrw mix reads and writes per --rwmixread"),
    Opt("rwmixread", _int_range(0, 100), 50, "percent of reads in rw/randrw"),
    # 64 MiB: a few dozen pages per call, what the device results were measured at; SGLang
    # hands its L3 backend 128 pages (256 MiB of Llama-3-8B 16-token pages).
    Opt("bs", _positive_size, 64 << 20,
        "bytes per call = one batch of whole pages (rounded down to pages, cut to size; "
        "default 64M)"),
    Opt("size", _positive_size, 256 << 20, "bytes of KV pages per job (each numjobs clone)"),
    Opt("numjobs", _int_range(1, 1024), 1, "clones of the job, one thread each, same tier"),
    Opt("iodepth", _int_range(1, 4096), 1, "batches in flight per thread"),
    Opt("runtime", _time, None, "stop after this long (seconds; 500ms, 2m...)"),
    Opt("time_based", _bool, False, "repeat the workload until --runtime", flag=True),
    Opt("ramp_time", _time, 0.0, "run this long before counting"),
    Opt("directory", _str, None,
        "store directories, ':'-separated (default: a fresh temporary directory)"),
    Opt("direct", _bool, True,
        "O_DIRECT where the file system takes it (default 1, unlike fio, so reads hit the disk)"),
    Opt("ioengine", _choice(ENGINES), "gdskv",
        "gdskv (tier put/get) | raw (one contiguous buffer, same backend, no gather, no "
        "directory: the I/O ceiling) | hicachefile (SGLang's HiCacheFile, one file per page)"),
    Opt("raw_io", _choice(("pool", "caller")), "pool",
        "raw engine: every call through the backend's threads (pool: kvikio's pwrite/pread, "
        "what --compare compares with) or, like gdskv's io_on_caller, a call the pool would "
        "run on one thread moved on the calling thread (caller)"),
    Opt("group_reporting", _bool, False, "report numjobs clones as one", flag=True),
    Opt("verify", _verify, False,
        "fio's methods (crc32c, md5, xxhash, ...), 1 or 0: compare every restored byte with "
        "what was written (a write job then reads everything back, as fio's verify does); "
        "misses count as failures", flag=True),
    Opt("invalidate", _bool, True,
        "drop the page cache of the job's own files before read phases (fdatasync + fadvise "
        "DONTNEED, as fio's invalidate does; O_DIRECT reads bypass it anyway)"),
    Opt("drop_caches", _bool, False,
        "also drop the whole machine's page cache before read phases (root: "
        "/proc/sys/vm/drop_caches). A system-wide side effect: for a benchmark machine only",
        flag=True),
    Opt("kb_base", _kb_base, 1024,
        "1024 (fio's default: k, KB = 1024; KiB = 1000) or 1000 (k, KB = 1000; KiB = 1024)"),
    Opt("unlink", _bool, False,
        "remove the store this job made when it ends (default 0, as fio: the store is kept and "
        "the report's store line names it, for gdskv info/verify)", flag=True),
    Opt("randseed", _int_range(0), 0x5EED, "seed for data and random orders"),
    Opt("thread", _bool, True, "accepted for fio compatibility: clones are always threads",
        flag=True),
    Opt("stonewall", _bool, True,
        "accepted for fio compatibility: jobs always run one after another", flag=True),
    # KV options
    Opt("backend", _choice(("auto", "posix", "kvikio", "nixl")), "auto",
        "gdskv backend (auto: kvikio on a GPU, posix otherwise)"),
    Opt("mem", _choice(("gpu", "host")), None,
        "where the KV pool lives (default: gpu when CUDA is usable, host otherwise)"),
    Opt("model", _model, None, f"geometry preset: {', '.join(PRESETS)}"),
    Opt("layers", _int_range(1), None, "layers (overrides the preset)"),
    Opt("kv_heads", _int_range(1), None, "KV heads (overrides the preset)"),
    Opt("head_dim", _int_range(1), None, "head dim / MLA latent width (overrides the preset)"),
    Opt("dtype", _dtype, None, "KV dtype (default bfloat16)"),
    Opt("mla", _bool, None, "MLA: one latent row per token and layer", flag=True),
    Opt("page_tokens", _int_range(1, 256), 16, "tokens per page"),
    Opt("prefill_tflops", _positive_float, None,
        "sustained prefill TFLOPS: print restore vs. recompute per token and the break-even "
        "disk bandwidth (FLOPs/token from the model preset)"),
)
JOB_OPTION_NAMES = {o.name: o for o in JOB_OPTIONS}


def _key(text: str) -> str:
    return text.strip().lower().replace("-", "_")


#: fio options that have no meaning here, with what to use instead
NOT_HERE = {
    "filename": "gdskv-bench writes slab files of its own: give --directory=DIR (':'-separated "
                "for several drives) instead of --filename",
}


def unknown_option(key: str, flag: str = "") -> str:
    """The error for an unknown option: what to use instead, or the closest known name."""
    name = _key(key.lstrip("-").split("=", 1)[0])
    if name in NOT_HERE:
        return f"unknown option {key!r}: {NOT_HERE[name]}"
    hint = suggest(name, JOB_OPTION_NAMES)
    if hint and flag:
        hint = suggest(name, JOB_OPTION_NAMES, render=lambda n: flag + n.replace("_", "-"))
    return f"unknown option {key!r}{hint}"


#: size options, read again once the job's kb_base is known
SIZE_OPTIONS = ("bs", "size")


@dataclass
class JobOptions:
    """One job's options (fio names, ``-`` as ``_``). ``given`` records what was set, as text,
    and ``sources`` where (the command line or a job file), for the report."""
    values: dict[str, Any] = field(default_factory=dict)
    given: dict[str, str] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        if name in JOB_OPTION_NAMES:
            return JOB_OPTION_NAMES[name].default
        raise AttributeError(name)

    def set(self, key: str, raw: str | None, where: str = "") -> None:
        """Parse and set one option from text (``None`` = bare key, a flag)."""
        name = _key(key)
        opt = JOB_OPTION_NAMES.get(name)
        if opt is None:
            raise OptionError(where + unknown_option(key))
        if raw is None:
            if not opt.flag and opt.parse is not _bool:
                raise OptionError(f"{where}option {key!r} needs a value")
            raw = "1"
        try:
            self.values[name] = opt.parse(raw)
        except OptionError as exc:
            raise OptionError(f"{where}option {name}={raw}: {exc}") from None
        self.given[name] = str(raw)
        self.sources[name] = where.strip() or "command line"

    def apply_kb_base(self) -> None:
        """Read the size options again in the job's own ``kb_base`` (fio's rule)."""
        for name in SIZE_OPTIONS:
            if name in self.given:
                try:
                    self.values[name] = _positive_size(self.given[name], self.kb_base)
                except OptionError as exc:
                    raise OptionError(f"option {name}={self.given[name]}: {exc}") from None

    def copy(self) -> "JobOptions":
        return JobOptions(dict(self.values), dict(self.given), dict(self.sources))

    def replace(self, **values) -> "JobOptions":
        new = self.copy()
        for k, v in values.items():
            new.values[_key(k)] = v
            new.given[_key(k)] = str(v)
        return new


# -- job files ---------------------------------------------------------------------------------

_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def substitute_env(text: str, environ: Mapping[str, str], where: str = "") -> str:
    """Replace ``${VAR}`` from the environment; an unset variable is an error, as a silent
    empty directory or size would be worse."""
    def repl(m: re.Match) -> str:
        var = m.group(1)
        if var not in environ:
            raise OptionError(f"{where}environment variable ${{{var}}} is not set")
        return environ[var]
    return _ENV_RE.sub(repl, text)


def read_job_file(path: str, environ: Mapping[str, str] | None = None) -> list[JobOptions]:
    """Jobs of a fio-style INI file, ``[global]`` values merged under each job section."""
    env = os.environ if environ is None else environ
    parser = configparser.ConfigParser(allow_no_value=True, interpolation=None,
                                       delimiters=("=",), comment_prefixes=("#", ";"),
                                       inline_comment_prefixes=None, strict=True,
                                       default_section="\x00none")
    parser.optionxform = str  # keep keys as written for messages; normalised in JobOptions.set
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        parser.read_string(text, source=path)
    except OSError as exc:
        raise OptionError(f"cannot read job file {path!r}: {exc.strerror}") from None
    except configparser.Error as exc:
        errors = getattr(exc, "errors", None)
        line = errors[0][0] if errors else getattr(exc, "lineno", None)
        at = f"{path}:{line}" if line else path
        raise OptionError(f"job file {at}: {_syntax_message(exc)}") from None
    lines = _key_lines(text)
    base = JobOptions()
    jobs: list[JobOptions] = []
    for section in parser.sections():
        if section.lower() == "global":
            target = base
        else:
            target = base.copy()
            target.set("name", section, f"{path}:{lines.get((section, None), '?')} [{section}] ")
        for key, raw in parser.items(section):
            where = f"{path}:{lines.get((section, key), '?')} [{section}] "
            value = None if raw is None else substitute_env(raw.strip(), env, where)
            target.set(key, value, where)
        if target is not base:
            target.apply_kb_base()
            jobs.append(target)
    if not jobs:
        raise OptionError(f"job file {path}: no job sections (only [global])")
    return jobs


def _key_lines(text: str) -> dict[tuple[str, str | None], int]:
    """(section, key) -> line number, and (section, None) for the header: configparser keeps
    no line numbers, and an error should point at the line to fix."""
    index: dict[tuple[str, str | None], int] = {}
    section = None
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("[") and s.endswith("]"):
            section = s[1:-1]
            index.setdefault((section, None), n)
        elif s and s[0] not in "#;" and section is not None:
            index.setdefault((section, s.split("=", 1)[0].strip()), n)
    return index


def _syntax_message(exc: configparser.Error) -> str:
    if isinstance(exc, configparser.MissingSectionHeaderError):
        return f"{exc.line.strip()!r} comes before any [section] header (start with [global] " \
               "or [jobname])"
    if getattr(exc, "errors", None):
        return f"cannot parse {exc.errors[0][1].strip()!r} (expected key=value, a bare key, " \
               "a [section] or a # comment)"
    return str(exc).splitlines()[0]


# -- command line -----------------------------------------------------------------------------

@dataclass
class Invocation:
    """Everything the CLI was asked: jobs plus the global (non-job) options."""
    jobs: list[JobOptions]
    output_format: tuple[str, ...] = ("normal",)
    output: str | None = None
    compare: bool = False
    #: --compare: run each job's engines this many times, the order reversed every other round
    #: (gdskv, raw | raw, gdskv | ...), and pool the rounds' samples
    compare_rounds: int = 1
    sweep: tuple[str, list] | None = None
    sweep_dir: str | None = None
    metrics_port: int | None = None


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so the CLI decides how to report (status 2)."""

    def error(self, message: str):  # type: ignore[override]
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            # one line per argument is argparse's; a hint per argument is ours
            message = "; ".join(unknown_option(arg, flag="--")
                                for arg in message[len(prefix):].split())
        raise OptionError(message)


def _arg_type(opt: Opt) -> Callable[[str], Any]:
    def parse(text: str):
        try:
            return text, opt.parse(text)  # keep the text as given, for fio's "job options"
        except OptionError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    parse.__name__ = opt.name  # argparse names the type in some messages
    return parse


_port = int_between(1, 65535, "a port number")
_rounds = int_between(1, 100, "a number of rounds")


def _output_formats(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip().lower() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in OUTPUT_FORMATS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma list of {', '.join(OUTPUT_FORMATS)}")
    return parts


def _sweep(text: str) -> tuple[str, list]:
    key, sep, values = text.partition("=")
    name = _key(key)
    if not sep or name not in JOB_OPTION_NAMES or name in ("name", "description", "directory"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected OPTION=V1,V2,... over a job option (e.g. bs=64k,1M,16M or "
            "page-tokens=16,64)")
    opt = JOB_OPTION_NAMES[name]
    parsed = []
    for v in values.split(","):
        if not v.strip():
            continue
        try:
            parsed.append((v.strip(), opt.parse(v)))
        except OptionError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {name}={v}: {exc}") from None
    if not parsed:
        raise argparse.ArgumentTypeError(f"{text!r}: no values to sweep")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for _, v in parsed):
        raise argparse.ArgumentTypeError(f"{text!r}: only numeric options can be swept "
                                         "(bs, size, page-tokens, numjobs, iodepth...)")
    return name, parsed


def env_help_text() -> str:
    """Every ``GDSKV_*`` variable with its default and meaning (``--help-env``)."""
    rows = []
    for f in dataclasses.fields(TierConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, enum.Enum):
            default = default.value
        elif isinstance(default, bool):
            default = str(default).lower()
        elif isinstance(default, int) and f.name in ("capacity", "staging_size",
                                                     "io_chunk_size"):
            default = fmt_size_exact(default)
        elif isinstance(default, tuple):
            default = ":".join(default) or "-"
        rows.append((ENV_PREFIX + f.name.upper(), str(default), FIELD_DOCS[f.name]))
    width = max(len(r[0]) for r in rows)
    lines = ["GDSKV_* environment variables: the tier's configuration. gdskv-bench reads them as "
             "the library does;",
             "an unknown GDSKV_* name or a malformed value is an error naming it.", "",
             f"  {'variable':<{width}}  {'default':<8}  meaning"]
    lines += [f"  {var:<{width}}  {default:<8}  {doc}" for var, default, doc in rows]
    return "\n".join(lines) + "\n"


class _HelpEnv(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        sys.stdout.write(env_help_text())  # stdout, as --help
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gdskv-bench", allow_abbrev=False,
                usage="gdskv-bench [options] [jobfile ...]  (--help lists the options)",
                description="fio-style benchmark of the gdskv KV-cache spill tier",
                epilog="Job files: fio INI ([global] + one section per job, bare keys for "
                       "booleans, ${ENV} substitution). Command-line job options override "
                       "the files' values. Sizes as fio reads them, with kb_base=1024 (the "
                       "default): k/KB/M/MB/G/GB = 1024^n, KiB/MiB/GiB = 1000^n (fio's "
                       "compatibility rule); --kb_base=1000 swaps the two.")
    p.add_argument("jobfiles", nargs="*", help="fio-style job files")
    g = p.add_argument_group("job options (fio names)")
    for opt in JOB_OPTIONS:
        flags = ["--" + opt.name]
        if "_" in opt.name:
            flags.append("--" + opt.name.replace("_", "-"))
        g.add_argument(*flags, dest=opt.name, type=_arg_type(opt), default=argparse.SUPPRESS,
                       nargs="?" if (opt.flag or opt.parse is _bool) else None,
                       const=("1", True) if (opt.flag or opt.parse is _bool) else None,
                       metavar=opt.name.upper(), help=opt.help)
    o = p.add_argument_group("output and modes")
    o.add_argument("--output-format", "--output_format", dest="output_format",
                   type=_output_formats, default=("normal",),
                   help="normal|json|terse, or a comma list of them")
    o.add_argument("--output", default=None, help="write the report to this file")
    o.add_argument("--metrics-port", "--metrics_port", dest="metrics_port", type=_port,
                   default=None, help="serve the tiers' gdskv_* Prometheus metrics on this "
                   "port during the run (http://HOST:PORT/metrics)")
    o.add_argument("--compare", nargs="?", const=("1", True),
                   type=_arg_type(Opt("compare", _bool, False, "")), default=("0", False),
        help="run each job with ioengine gdskv, raw and hicachefile (when sglang is importable)"
             " back to back and print the ratios")
    o.add_argument("--compare-rounds", "--compare_rounds", dest="compare_rounds",
                   type=_rounds, default=1,
                   help="with --compare: run each job's engines N times, the order reversed "
                        "every other round (ABBA...), and compare the pooled samples: a "
                        "machine that drifts during a run weighs on both engines alike")
    o.add_argument("--sweep", type=_sweep, default=None,
                   help="OPTION=V1,V2,...: one run per value, one JSON each plus a PNG plot")
    o.add_argument("--sweep-dir", "--sweep_dir", dest="sweep_dir", default=None,
                   help="where sweep JSON files and the PNG go (default ./gdskv-sweep)")
    p.add_argument("--help-env", "--help_env", action=_HelpEnv,
                   help="list the GDSKV_* environment variables and exit")
    p.add_argument("--version", action="version", version="gdskv-bench 0.1.0")
    return p


def _bare_booleans(argv: Sequence[str]) -> list[str]:
    """``--compare jobs.ini`` as fio reads it: a boolean option with no ``=`` takes the next
    word as its value only when that word is a boolean; otherwise the option is bare (true)
    and the word stays a job file (argparse's optional value would swallow it)."""
    flags = {"--compare"}
    for opt in JOB_OPTIONS:
        if opt.flag or opt.parse is _bool:
            flags |= {"--" + opt.name, "--" + opt.name.replace("_", "-")}
    out = list(argv)
    for i, word in enumerate(out[:-1]):
        if word in flags and out[i + 1].strip().lower() not in _TRUE_WORDS + _FALSE_WORDS:
            out[i] = word + "=1"
    return out


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Invocation:
    """Parse a command line into jobs; raises :class:`OptionError` on any bad input."""
    ns = build_parser().parse_args(_bare_booleans(argv))
    cli = JobOptions()
    for opt in JOB_OPTIONS:
        if hasattr(ns, opt.name):
            text, value = getattr(ns, opt.name)
            cli.values[opt.name] = value
            cli.given[opt.name] = text
            cli.sources[opt.name] = "command line"
    if ns.jobfiles:
        jobs = []
        for path in ns.jobfiles:
            for job in read_job_file(path, environ):
                for part in ("values", "given", "sources"):
                    getattr(job, part).update({k: v for k, v in getattr(cli, part).items()
                                               if k != "name"})
                jobs.append(job)
    else:
        jobs = [cli]
    for job in jobs:
        job.apply_kb_base()
    if ns.compare_rounds > 1 and not ns.compare[1]:
        raise OptionError(f"--compare-rounds={ns.compare_rounds}: rounds are of a comparison; "
                          "add --compare")
    return Invocation(jobs=jobs, output_format=ns.output_format, output=ns.output,
                      compare=ns.compare[1], compare_rounds=ns.compare_rounds, sweep=ns.sweep,
                      sweep_dir=ns.sweep_dir, metrics_port=ns.metrics_port)


def job_options_dict(job: JobOptions) -> dict[str, str]:
    """fio's ``"job options"``: what was set for the job, as strings."""
    return dict(job.given)


__all__ = ["OptionError", "JobOptions", "Invocation", "JOB_OPTIONS", "parse_args",
           "read_job_file", "substitute_env", "build_parser", "job_options_dict",
           "RW_MODES", "ENGINES", "OUTPUT_FORMATS"]
