"""Tier configuration: one frozen dataclass, every field settable as a ``GDSKV_*`` env var.

``TierConfig.from_env()`` reads the environment; an unknown ``GDSKV_*`` name or a malformed value
raises :class:`ConfigError` naming the variable and the value. Field ``foo_bar`` is
``GDSKV_FOO_BAR``; see ``FIELD_DOCS`` (also printed by ``gdskv-bench --help-env``).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

ENV_PREFIX = "GDSKV_"


class ConfigError(ValueError):
    """A bad configuration value; the message names the field or variable and the value."""


class UnknownFieldError(ConfigError, TypeError):
    """A keyword that is no field (``TierConfig(capacty=...)``): a TypeError, as Python's own
    for an unexpected keyword, and a ConfigError, as a misspelt ``GDSKV_*`` variable is."""


def suggest(name: str, known: Iterable[str], render: Callable[[str], str] = str) -> str:
    """`` (did you mean X?)`` naming the closest of ``known``, or "" when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {render(close[0])}?)" if close else ""


class BackendKind(str, enum.Enum):
    AUTO = "auto"      # kvikio where a CUDA device exists, posix otherwise
    POSIX = "posix"
    KVIKIO = "kvikio"
    NIXL = "nixl"


class DirectIO(str, enum.Enum):
    AUTO = "auto"      # O_DIRECT where the file system takes it, buffered (and said so) otherwise
    ON = "on"          # O_DIRECT or fail
    OFF = "off"        # buffered I/O


class Eviction(str, enum.Enum):
    LRU = "lru"        # evict least-recently-used unpinned pages to make room
    NONE = "none"      # never evict: a put that does not fit fails


class SyncPolicy(str, enum.Enum):
    DATA = "data"      # fdatasync slab files and the journal before a page is READY (safe)
    NONE = "none"      # rely on O_DIRECT/page cache; a power loss may lose recent pages


class NixlPlugin(str, enum.Enum):
    AUTO = "auto"      # GDS_MT, then GDS, then POSIX with a pinned bounce buffer
    GDS = "GDS"
    GDS_MT = "GDS_MT"
    POSIX = "POSIX"


_SIZE_RE = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
#: the largest size or count a field takes (file offsets and numpy indices are 64-bit signed)
MAX_INT = (1 << 63) - 1
#: the longest cluster discovery or follow interval (ms)
MAX_CLUSTER_INTERVAL_MS = 60_000
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _check_range(value: int, what: str) -> int:
    if value > MAX_INT:
        raise ConfigError(f"{what}: {value} is larger than this platform handles (at most "
                          f"2**63-1); give a realistic value")
    return value


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Parse ``64GiB``, ``512M``, ``4k``, ``1.5G`` or a plain byte count.

    Like fio, a bare suffix (``k``, ``M``...) and ``KiB``/``MiB`` are powers of 1024; ``KB``/``MB``
    (with a B and no i) are powers of 1000.
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ConfigError(f"{what}: expected a size (examples: 4096, 4k, 64MiB, 2G), got "
                          f"{text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"{what}: size must be >= 0, got {text}")
        return _check_range(text, what)
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"{what}: cannot parse size {text!r} (examples: 4096, 4k, 64MiB, 2G)")
    whole, frac, unit, suffix = m.groups()
    base = 1000 if suffix.lower() == "b" and unit else 1024
    scale = base ** _UNITS[unit.lower()]
    frac = frac or ""
    # exact integer arithmetic: floats would round sizes beyond 2**53
    numerator = (int(whole) * 10 ** len(frac) + int(frac or 0)) * scale
    value, rest = divmod(numerator, 10 ** len(frac))
    if rest:
        raise ConfigError(f"{what}: size {text!r} is not a whole number of bytes")
    return _check_range(value, what)


def parse_bool(value, what: str) -> bool:
    """A boolean from Python, JSON or the environment: ``True``/``False``, ``1``/``0`` or
    true/false, yes/no, on/off, 1/0 in any case; anything else is a ConfigError."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        t = value.strip().lower()
        if t in _TRUE:
            return True
        if t in _FALSE:
            return False
    raise ConfigError(f"{what}: expected a boolean (true/false, 1/0, yes/no, on/off), got "
                      f"{value!r}")


def parse_int(value, what: str) -> int:
    """An integer from Python, JSON (a number) or the environment (decimal text)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return _check_range(value, what)
    if isinstance(value, str):
        try:
            return _check_range(int(value.strip()), what)
        except ValueError:
            pass
    raise ConfigError(f"{what}: expected an integer, got {value!r}")


def parse_directories(value, what: str = "directories") -> tuple[str, ...]:
    """Store directories: a list of paths, or one string with ``:`` or ``,`` between them."""
    if isinstance(value, str):
        paths = split_dirs(value)
    elif isinstance(value, os.PathLike):
        paths = (os.fspath(value),)
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (str, os.PathLike))
                                                  for p in value):
        paths = tuple(os.fspath(p) for p in value)
    else:
        raise ConfigError(f"{what}: expected a list of directory paths (or one string with ':' "
                          f"or ',' between them), got {value!r}")
    for p in paths:
        if not isinstance(p, str) or "\0" in p or not p.strip():
            raise ConfigError(f"{what}: {p!r} is not a usable path (empty, or it holds a NUL "
                              "byte)")
    return paths


@dataclass(frozen=True)
class TierConfig:
    #: store directories, one per drive; slots are striped across them
    directories: tuple[str, ...] = ()
    #: disk capacity of the store (all directories together)
    capacity: int = 16 << 30
    backend: BackendKind = BackendKind.AUTO
    #: bounded staging buffer on the pool's device; large batches go through it in chunks.
    #: Counts page payload: a part may be up to 1/16 larger so that it holds whole pages with
    #: their slot trailers (``staging.staging_part_pages``)
    staging_size: int = 256 << 20
    #: staging is cut into this many parts: one is gathered/scattered while the others' I/O runs
    pipeline_depth: int = 4
    #: threads moving bytes (POSIX thread pool, kvikio's thread pool)
    io_threads: int = 16
    #: bytes per I/O call; large extents are cut into pieces of this size for parallelism
    io_chunk_size: int = 16 << 20
    #: the thread that waits for an I/O polls its completion for up to this many µs
    #: (releasing the GIL between polls, one thread at a time) before it sleeps on it; the
    #: host then stays warm for the rest of the call. 0: sleep at once
    io_poll_us: int = 0
    #: a data call of one chunk whose I/O the backend's pool would run on one thread anyway
    #: (kvikio: one extent of GPU memory within a task; posix: one piece) moves its bytes on
    #: the calling thread, with no hand-off to the pool and back; off: always through the pool
    io_on_caller: bool = True
    #: slab files on a file system held in memory (tmpfs, ramfs: /dev/shm) are read from
    #: their own pages, mapped: GPU tiers on kvikio by one GPU copy, once registered with CUDA
    #: in the background (``gdskv.backends.memory_files``), instead of through kvikio's bounce
    #: buffers; the posix backend by one copy-and-checksum pass from the mapping instead of
    #: ``preadv`` and a checksum pass (``gdskv.backends.posix``); false: both read by I/O calls
    map_memory_files: bool = True
    #: data calls (``put``/``get``, ``put_pages``/``get_pages``, sync or async) that arrive
    #: while another of their kind (operation, pool) runs wait and are then run as one call,
    #: keys and slots or regions concatenated (as a group commit), so calls in flight from
    #: several threads pay a call's fixed host and CUDA cost once; a call alone runs at once,
    #: and calls of another kind never wait. Off: every call runs on its own
    combine_calls: bool = True
    #: with ``combine_calls``: calls of one kind that run at once, each on its own, while none
    #: waits; a call that finds this many running (or others waiting) waits and is combined
    #: with the others that wait, and the kind then runs one batch at a time. 1 combines the
    #: most (the least host work a page); 4 lets a few threads' calls overlap their I/O
    #: (large pages, a disk) as they did before combining
    calls_at_once: int = 4
    direct_io: DirectIO = DirectIO.AUTO
    eviction: Eviction = Eviction.LRU
    sync: SyncPolicy = SyncPolicy.DATA
    #: slab files per directory (more files = more parallel queues on one drive)
    files_per_dir: int = 4
    #: verify page checksums on every read (a mismatch is a miss, never wrong data); off trusts
    #: the disk: bit rot, a damaged journal or a replaced file can then return wrong bytes
    verify: bool = True
    #: reserve the slab files' full size on disk when the store is created (posix_fallocate),
    #: so a full disk shows up at creation; off: files grow as pages are written and a write
    #: that finds no space (ENOSPC/EFBIG) fails just those pages
    preallocate: bool = True
    #: admission filter: store a page only once it has been offered this many times (1 = always)
    admit_after: int = 1
    nixl_plugin: NixlPlugin = NixlPlugin.AUTO
    #: NIXL POSIX plugin queue: aio, uring or posix_aio (where the plugin offers it)
    nixl_posix_queue: str = "aio"
    #: put_pages/get_pages on a CPU tier: move host regions straight between the caller's
    #: memory and the slab files where their alignment allows (no staging copy); off: always
    #: through staging
    in_place: bool = True
    #: host page I/O and checksums through the native page engine (the C extension
    #: ``gdskv.native._pages``, the GIL released) where it loaded; off: the pure-Python path
    #: (``os.preadv``/``pwritev`` and the crc32c package), the fallback and the tests' oracle.
    #: Both write the same bytes; ``Tier.stats()["page_engine"]`` says which runs and why
    native: bool = True
    #: GPU pools: a chunk shape a thread has moved before replays its kernel launches (a
    #: restore's verify + scatter, a spill's gather + checksum) from a captured CUDA graph (one
    #: launch call instead of two Triton launches); off: launch the kernels every time
    launch_graphs: bool = True
    #: follower mode: open a store another process owns and writes, read-only (no lock, no
    #: writes; the directory follows the writer's journal). Needs verify: a slot the writer
    #: reuses while a follower reads it then fails its checksum and is a miss
    read_only: bool = False
    #: cluster mode: ``directories`` are shared by several nodes (a network or parallel file
    #: system); this node writes its own namespace ``<directory>/<node_id>`` and reads every
    #: other node's as a follower (:mod:`gdskv.cluster`)
    cluster: bool = False
    #: this node's namespace in a cluster store (a directory name, taken as given: never
    #: trimmed); "" = host name + GPU index (and the engine's ranks, which the adapters add)
    node_id: str = ""
    #: cluster: a put skips keys another node already holds (true), or stores its own copy
    cluster_dedup: bool = True
    #: cluster: milliseconds between listings of the shared directory for new or vanished
    #: namespaces (one readdir and one manifest stat per namespace each time); 1..60000
    cluster_discovery_ms: int = 1000
    #: cluster: at most how often (ms) a lookup or read catches up with another node's journal
    #: (one stat of it each time; new records are read only when it grew); 1..60000
    cluster_follow_ms: int = 50
    #: cluster: staging buffer of each other node's follower tier (there is one per node, so
    #: it is kept smaller than staging_size; at least one slot per pipeline part); a
    #: ClusterStore refuses more than the memory free on its device
    cluster_peer_staging_size: int = 64 << 20

    def __new__(cls, *args, **kwargs):
        # the generated __init__'s TypeError would name no alternative: a misspelt field gets
        # the did-you-mean of a misspelt GDSKV_* variable (dataclasses.replace comes here too)
        known = [f.name for f in dataclasses.fields(cls)]
        for name, value in kwargs.items():
            if name not in known:
                raise UnknownFieldError(f"{cls.__name__}: unknown field {name}={value!r}"
                                        f"{suggest(name, known)}; known: {', '.join(known)}")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        # Every field is checked and converted here, the same way whether it came from Python,
        # JSON (an engine's extra config) or the environment (text).
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(f, getattr(self, f.name)))
        if not 1 <= self.calls_at_once <= 64:
            raise ConfigError(f"calls_at_once: must be an integer in 1..64, got "
                              f"{self.calls_at_once!r}")
        if not 2 <= self.pipeline_depth <= 64:
            raise ConfigError(f"pipeline_depth: must be an integer in 2..64, got "
                              f"{self.pipeline_depth!r}")
        for name in ("capacity", "staging_size", "io_threads", "io_chunk_size",
                     "files_per_dir", "admit_after", "cluster_peer_staging_size"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("cluster_discovery_ms", "cluster_follow_ms"):
            # a longer interval would leave other nodes' new pages or namespaces unseen for
            # longer than they are worth (2**63-1 ms: never)
            value = getattr(self, name)
            if not 1 <= value <= MAX_CLUSTER_INTERVAL_MS:
                raise ConfigError(f"{name}: must be 1..{MAX_CLUSTER_INTERVAL_MS} ms (at most a "
                                  f"minute), got {value!r}")
        if self.io_poll_us < 0:
            raise ConfigError(f"io_poll_us: must be 0 (off) or a positive number of µs, got "
                              f"{self.io_poll_us!r}")
        if self.io_chunk_size % 4096:
            raise ConfigError(f"io_chunk_size: must be a multiple of 4096, got {self.io_chunk_size}")
        if self.read_only and not self.verify:
            raise ConfigError("read_only: a read-only follower needs verify=true (the writer may "
                              "reuse a slot while it is read; only the checksum catches that)")
        if self.cluster and not self.verify:
            raise ConfigError("cluster: reading other nodes' pages needs verify=true (a node may "
                              "reuse a slot while another reads it; only the checksum catches "
                              "that)")
        if self.node_id:
            check_node_id(self.node_id)
            if not self.cluster:
                raise ConfigError(f"node_id: {self.node_id!r} is set but cluster is off; set "
                                  "cluster=true (GDSKV_CLUSTER=true) to share a store across "
                                  "nodes, or leave node_id unset")
        if self.nixl_posix_queue not in ("aio", "uring", "posix_aio"):
            raise ConfigError(f"nixl_posix_queue: must be aio, uring or posix_aio, got "
                              f"{self.nixl_posix_queue!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "TierConfig":
        """Build a config from ``GDSKV_*`` variables; keyword overrides win over the env."""
        env = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict = {}
        for var, text in env.items():
            if not var.startswith(ENV_PREFIX):
                continue
            name = var[len(ENV_PREFIX):].lower()
            if name not in fields:
                known = [ENV_PREFIX + n.upper() for n in fields]
                raise ConfigError(f"unknown environment variable {var}={text!r}"
                                  f"{suggest(var, known)}; known: {', '.join(known)}")
            try:
                values[name] = _coerce(fields[name], text)
                if name != "directories":  # validate this one value, naming the var
                    # (node_id needs cluster on: that pair is checked with the rest below)
                    cls(**{name: values[name]}, **({"cluster": True} if name == "node_id"
                                                   else {}))
            except ConfigError as exc:
                raise ConfigError(f"{var}={text!r}: {exc}") from None
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes) -> "TierConfig":
        return dataclasses.replace(self, **changes)


_SIZE_FIELDS = ("capacity", "staging_size", "io_chunk_size", "cluster_peer_staging_size")
#: a node id is one directory name on every file system gdskv runs on
_NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_node_id(node_id: str) -> str:
    """A node id as a cluster namespace's directory name: letters, digits, ``.``, ``_``,
    ``-``, starting with a letter or digit, at most 128 characters."""
    if not isinstance(node_id, str) or not _NODE_ID_RE.fullmatch(node_id):
        blank = isinstance(node_id, str) and node_id.strip() != node_id
        raise ConfigError(f"node_id: {node_id!r} cannot name a namespace directory; use 1-128 "
                          "letters, digits, '.', '_' or '-', starting with a letter or digit "
                          "(e.g. node07-gpu3)" + ("; it has whitespace (leave node_id unset "
                                                  "or empty for the default)" if blank else ""))
    return node_id

_ENUMS = {"BackendKind": BackendKind, "DirectIO": DirectIO, "Eviction": Eviction,
          "SyncPolicy": SyncPolicy, "NixlPlugin": NixlPlugin}


def split_dirs(text: str) -> tuple[str, ...]:
    """``/a:/b`` (fio's separator) or ``/a,/b`` -> ("/a", "/b")."""
    return tuple(p for p in re.split(r"[:,]", text) if p.strip())


def _coerce(f: dataclasses.Field, value):
    """One field's value, checked and converted to its type (ConfigError naming the field)."""
    if f.name == "directories":
        return parse_directories(value)
    if f.type == "bool":
        return parse_bool(value, f.name)
    if f.name in _SIZE_FIELDS:
        return parse_size(value, what=f.name)
    if f.type == "int":
        return parse_int(value, f.name)
    if f.type in _ENUMS:
        return _parse_enum(_ENUMS[f.type], value, f.name)
    if not isinstance(value, str):
        raise ConfigError(f"{f.name}: expected a string, got {value!r}")
    # a node id names a directory: taken as given, so "a\n" or "  " is refused, not trimmed
    return value if f.name == "node_id" else value.strip()


def _parse_enum(enum_cls: type[enum.Enum], value, what: str):
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        text = value.strip()
        for member in enum_cls:
            if text.lower() == member.value.lower():  # NIXL plugins are upper case
                return member
    raise ConfigError(f"{what}: {value!r} is not one of {', '.join(m.value for m in enum_cls)}")


#: what each ``TierConfig`` field (``GDSKV_<FIELD>``) means, for ``gdskv-bench --help-env``
FIELD_DOCS: dict[str, str] = {
    "directories": "store directories, ':' or ',' separated (one per drive; slots are striped)",
    "capacity": "disk capacity of the store (64GiB, 512M...; reserved at creation if preallocate;"
                " used in whole io_chunk_size stripes, the same number per slab file)",
    "backend": "auto (kvikio on a CUDA device, posix otherwise), posix, kvikio or nixl",
    "staging_size": "staging buffer on the pool's device (the tier's only GPU memory)",
    "pipeline_depth": "staging parts shared by concurrent calls, also the async workers (2..64)",
    "io_threads": "I/O threads (POSIX pool, kvikio thread pool)",
    "io_chunk_size": "stripe unit and largest I/O, a multiple of 4096",
    "io_poll_us": "poll an I/O's completion up to this many µs before sleeping on it (0: off)",
    "io_on_caller": "a one-chunk call whose I/O is one pool task moves it on the calling thread",
    "map_memory_files": "store on tmpfs/ramfs: reads copy from the slab files' own pages "
                        "(mapped; kvikio: GPU copies, registered with CUDA; posix: one "
                        "copy-and-checksum pass); false: read by I/O calls",
    "combine_calls": "data calls arriving while another of their kind runs wait, run as one",
    "calls_at_once": "calls of one kind that run at once before more wait to be combined",
    "direct_io": "auto (O_DIRECT where accepted, else buffered and said so), on or off",
    "eviction": "lru, or none (a put that does not fit fails those pages)",
    "sync": "data (fdatasync before a page is READY) or none",
    "files_per_dir": "slab files per directory",
    "verify": "verify page checksums on read (a mismatch is a miss)",
    "preallocate": "reserve the slab files' space at creation (false: grow as written)",
    "in_place": "CPU tier: host page regions move straight to/from the files (no staging copy)",
    "native": "host page I/O and checksums in the C extension where it loaded (false: Python)",
    "launch_graphs": "GPU pools: repeated chunk shapes replay their kernel launches (CUDA graph)",
    "read_only": "follower: open a store another process writes, read-only (needs verify)",
    "admit_after": "store a page only once it has been offered this many times (SSD wear)",
    "nixl_plugin": "auto (GDS_MT, GDS, then POSIX), GDS, GDS_MT or POSIX",
    "nixl_posix_queue": "NIXL POSIX plugin queue: aio, uring or posix_aio",
    "cluster": "share directories with other nodes: write <dir>/<node_id>, read the others'",
    "node_id": "this node's namespace in a cluster (default: host name + GPU index + ranks)",
    "cluster_dedup": "cluster: a put skips keys another node already holds",
    "cluster_discovery_ms": "cluster: ms between listings of the shared directory for nodes "
                            "(1..60000)",
    "cluster_follow_ms": "cluster: ms between catch-ups with another node's journal (one stat; "
                         "1..60000)",
    "cluster_peer_staging_size": "cluster: staging buffer of each other node's follower tier",
}

