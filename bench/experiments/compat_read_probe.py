"""How fast can a file's bytes reach GPU memory without GPUDirect Storage (kvikio compat mode)?

One file (default 4 GiB, the size of a 32k-token Llama-3-8B restore) read into one GPU buffer,
the ways a compat-mode read can go (each named by its settings), alternating in one process so
each compares reads made in the same state of the machine:

- ``kvikio``: ``CuFile.pread`` of the whole file (kvikio's compat mode: each task preads into a
  pinned bounce buffer, then copies it to the GPU and waits for the copy; ``--kvikio-task``
  KiB tasks, ``--kvikio-bounce`` KiB bounce buffers, ``--kvikio-threads``);
- ``pipe``: ``--threads`` threads, each with two pinned buffers of ``--piece`` bytes: it preads
  a piece into one buffer while the other's host-to-device copy runs on its own stream (the
  copy of the last piece waited for only before that buffer is refilled);
- ``h2d``: one pinned buffer of the whole size copied to the GPU (the copy engine's ceiling;
  no file read);
- ``mapped`` (``--mapped``, a file on a RAM-backed file system): the file mapped
  (``MAP_SHARED``) and registered with CUDA once (``cudaHostRegister``, timed apart as
  ``register_ms``), then each read one copy from the mapping: the copy engine reads the file's
  own pages, no bounce copy. Before each copy a few bytes are rewritten through ``pwrite``, so
  the check also shows a write through the file is what the mapping's copy reads.

Usage: python bench/experiments/compat_read_probe.py --dir /dev/shm --gib 4 --rounds 3
Prints a line per way (median of the rounds); ``--json`` writes every sample.

Results it produced: ``h100-2026-11-27/compat-read/`` (bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch


def make_file(path: str, nbytes: int) -> None:
    block = os.urandom(64 << 20)
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n


def kvikio_read(path: str, gpu: torch.Tensor) -> float:
    import kvikio
    with kvikio.CuFile(path, "r") as f:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = f.pread(gpu).get()
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
    if got != gpu.numel():
        raise RuntimeError(f"kvikio read {got} of {gpu.numel()}")
    return s


class Pipe:
    """``threads`` workers, each with two pinned ``piece``-byte buffers and a stream."""

    def __init__(self, threads: int, piece: int, device: torch.device) -> None:
        self.threads, self.piece = threads, piece
        self.buffers = [[torch.empty(piece, dtype=torch.uint8).pin_memory() for _ in range(2)]
                        for _ in range(threads)]
        self.streams = [torch.cuda.Stream(device) for _ in range(threads)]

    def read(self, path: str, gpu: torch.Tensor) -> float:
        n, piece = gpu.numel(), self.piece
        pieces = [(o, min(piece, n - o)) for o in range(0, n, piece)]
        fd = os.open(path, os.O_RDONLY)
        errors: list[BaseException] = []

        def work(k: int) -> None:
            try:
                stream, bufs = self.streams[k], self.buffers[k]
                done = [None, None]  # the event of each buffer's last copy
                for j, (offset, length) in enumerate(pieces[k::self.threads]):
                    b = j % 2
                    if done[b] is not None:
                        done[b].synchronize()
                    view = memoryview(bufs[b].numpy())[:length]
                    got = os.preadv(fd, [view], offset)
                    if got != length:
                        raise RuntimeError(f"short read {got} of {length} at {offset}")
                    with torch.cuda.stream(stream):
                        gpu[offset:offset + length].copy_(bufs[b][:length], non_blocking=True)
                        done[b] = torch.cuda.Event()
                        done[b].record(stream)
                stream.synchronize()
            except BaseException as exc:  # noqa: BLE001 - raised by the caller
                errors.append(exc)

        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            workers = [threading.Thread(target=work, args=(k,)) for k in range(self.threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            torch.cuda.synchronize()
            s = time.perf_counter() - t0
        finally:
            os.close(fd)
        if errors:
            raise errors[0]
        return s


class Mapped:
    """The file mapped and registered with CUDA (page-locked where it lies)."""

    def __init__(self, path: str, nbytes: int) -> None:
        import ctypes
        import mmap
        self.fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.host = torch.frombuffer(self.map, dtype=torch.uint8)
        t0 = time.perf_counter()
        err = torch.cuda.cudart().cudaHostRegister(self.address, nbytes, 0)
        self.register_ms = (time.perf_counter() - t0) * 1e3
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the mapping failed: {err}")

    def read(self, gpu: torch.Tensor, reference: torch.Tensor, step: int) -> float:
        # a write through the file first: the copy below must see it (the same page cache)
        stamp = bytes([step % 251] * 64)
        os.pwrite(self.fd, stamp, 4096 * step)
        reference[4096 * step:4096 * step + 64] = step % 251
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gpu.copy_(self.host, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def close(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.address)
        del self.host
        self.map.close()
        os.close(self.fd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="*", default=[], help="pipe ways' threads")
    p.add_argument("--piece", type=int, nargs="+", default=[4, 16], help="MiB")
    p.add_argument("--kvikio-threads", type=int, nargs="+", default=[16])
    p.add_argument("--kvikio-task", type=int, nargs="+", default=[4096], help="KiB")
    p.add_argument("--kvikio-bounce", type=int, default=16384,
                   help="KiB, the same for every way: a new size reallocates kvikio's pinned "
                        "bounce buffers, which would be timed")
    p.add_argument("--mapped", action="store_true",
                   help="also the file mapped and registered with CUDA (RAM-backed files)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    import kvikio.defaults
    device = torch.device("cuda")
    nbytes = int(args.gib * (1 << 30)) // (1 << 20) * (1 << 20)
    path = os.path.join(args.dir, f"gdskv-compat-probe-{os.getpid()}")
    make_file(path, nbytes)
    try:
        gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
        reference = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        with open(path, "rb") as f:  # what every path must read
            f.readinto(memoryview(reference.numpy()))
        expected = reference.to(device)
        mapped = Mapped(path, nbytes) if args.mapped else None
        ways = {}
        for kthreads in args.kvikio_threads:
            for task in args.kvikio_task:
                def k(task=task, kthreads=kthreads):
                    kvikio.defaults.set({"num_threads": kthreads, "task_size": task << 10,
                                         "bounce_buffer_size": args.kvikio_bounce << 10})
                    return kvikio_read(path, gpu)
                ways[f"kvikio task {task} KiB, {kthreads} threads, bounce "
                     f"{args.kvikio_bounce} KiB"] = k
        for threads in args.threads:
            for piece in args.piece:
                pipe = Pipe(threads, piece << 20, device)
                ways[f"pipe {threads} threads x 2 x {piece} MiB"] = \
                    lambda pipe=pipe: pipe.read(path, gpu)

        def h2d():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            gpu.copy_(reference, non_blocking=True)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        ways["h2d only (pinned, no file)"] = h2d
        if mapped is not None:
            steps = iter(range(1, 1 << 20))

            def from_mapping():
                s = mapped.read(gpu, reference, next(steps))
                expected.copy_(reference)  # (the stamp written through the file)
                return s
            ways["mapped + registered (one copy from the file's pages)"] = from_mapping
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        exact: dict[str, bool] = {}
        for _ in range(args.rounds):
            for name, way in ways.items():
                gpu.zero_()
                seconds[name].append(way())
                exact[name] = bool(torch.equal(gpu, expected))
        result = {"gpu": torch.cuda.get_device_name(device), "dir": args.dir, "bytes": nbytes,
                  "register_ms": mapped.register_ms if mapped is not None else None,
                  "compat_mode": bool(kvikio.defaults.is_compat_mode_preferred()),
                  "rounds": args.rounds, "ways": {
                      name: {"median_ms": statistics.median(s) * 1e3,
                             "gbps": nbytes / statistics.median(s) / 1e9,
                             "samples_ms": [round(x * 1e3, 2) for x in s],
                             "bit_exact": exact[name]} for name, s in seconds.items()}}
        if mapped is not None:
            mapped.close()
    finally:
        os.unlink(path)
    if mapped is not None:
        print(f"cudaHostRegister of the {nbytes >> 20} MiB mapping: {mapped.register_ms:.1f} ms")
    for name, way in result["ways"].items():
        print(f"{nbytes >> 20} MiB  {name:52s} {way['median_ms']:8.1f} ms {way['gbps']:5.1f} GB/s"
              f"  bit-exact {way['bit_exact']}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
