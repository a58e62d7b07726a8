"""Where a real 1-page spill's (or, with ``--get``, restore's) wall time goes, line by line, on
the GPU (issue 14).

Every statement of the spill path's functions (``Tier.put`` ... ``KvikioBackend._wait``) gets a
``perf_counter`` stamp after it, by rewriting those functions' modules' source (AST) before the
tier is made: about 0.2 µs a stamp, against the 1-2 µs a wrapper per function costs
(``call_profile.py --timeline``), and it sees single statements. Each line of the output is the
median time of one statement (the edge from the stamp before it), over real ``Tier.put`` calls
of one page (Llama-3-8B bf16, 16-token pages, GPU pool, kvikio); a raw kvikio write + fdatasync
of the same size to a rotating slot runs between the puts for the ratio.

    python bench/experiments/line_timeline.py /dev/shm/x 600

Results it produced (bench/RESULTS.md, "Host work moved into the write's wait, counters off
the critical path"), under bench/results/:
``h200-2026-11-26/call-overhead-6/call2/put_lines_start.txt`` (the code at that session's
start; fewer functions stamped), ``h200-2026-11-26/call-overhead-6/call5/put_lines_new.txt``
and ``h200-2026-11-26/call-overhead-6/call8/put_lines_fine.txt`` (these functions, as here);
the next session's, new and before side by side:
``h200-2026-11-26/call-overhead-7/call2/put_lines2_after.txt``,
``h200-2026-11-26/call-overhead-7/call6/put_lines2_after.txt`` and
``h100-2026-11-26/call-overhead-7/call9/put_lines2_after.txt``; with the staging parts,
admission, counters' ledger and call gate stamped too (``--top 250``):
``h200-2026-11-26/call-overhead-8/call5/put_lines3_after.txt`` and ``put_lines3_before.txt``.
"""
import ast
import collections
import importlib
import os
import shutil
import statistics
import sys
import threading
import time

ST = []          # (thread id, label, t)
_pc = time.perf_counter
_tid = threading.get_ident


def _stamp(label):
    ST.append((_tid(), label, _pc()))


class _Ins(ast.NodeTransformer):
    def __init__(self, names):
        self.names, self.cls = names, None

    def visit_ClassDef(self, node):
        prev, self.cls = self.cls, node.name
        self.generic_visit(node)
        self.cls = prev
        return node

    def visit_FunctionDef(self, node):
        q = f"{self.cls}.{node.name}" if self.cls else node.name
        if q in self.names:
            self._bodies(node, q)
        return node

    def _bodies(self, node, q):
        for field in ("body", "orelse", "finalbody", "handlers"):
            body = getattr(node, field, None)
            if not isinstance(body, list):
                continue
            if field == "handlers":
                for h in body:
                    self._bodies(h, q)
                continue
            new = []
            for st in body:
                if isinstance(st, (ast.FunctionDef, ast.Lambda)):
                    new.append(st); continue
                if isinstance(st, (ast.For, ast.While, ast.If, ast.Try, ast.With)):
                    self._bodies(st, q)
                lab = f"{q}:{st.lineno}"
                call = ast.Expr(ast.Call(ast.Name("_linestamp_", ast.Load()), [ast.Constant(lab)], []))
                if isinstance(st, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
                    new += [ast.Expr(ast.Call(ast.Name("_linestamp_", ast.Load()), [ast.Constant(lab + "<")], [])), st]
                else:
                    new += [st, call]
            setattr(node, field, new)


def install(modname, names):
    mod = importlib.import_module(modname)
    src = open(mod.__file__).read()
    tree = _Ins(set(names)).visit(ast.parse(src))
    ast.fix_missing_locations(tree)
    mod.__dict__["_linestamp_"] = _stamp
    exec(compile(tree, mod.__file__, "exec"), mod.__dict__)
    return mod


def begin():
    ST.clear(); _stamp("BEGIN")


def end():
    _stamp("END")
    return list(ST)


def summarize(calls, top=60):
    """calls: list of stamp lists (calling thread's). Median gap per (prev->label) edge."""
    edges = collections.defaultdict(list)
    totals = []
    for st in calls:
        tid = st[0][0]
        st = [s for s in st if s[0] == tid]
        totals.append(st[-1][2] - st[0][2])
        seen = collections.Counter()
        for (a, la, ta), (b, lb, tb) in zip(st, st[1:]):
            k = (la, lb); seen[k] += 1
            edges[k if seen[k] == 1 else (la, lb + f"#{seen[k]}")].append(tb - ta)
    n = len(calls)
    rows = sorted(((statistics.median(v + [0.0] * (n - len(v))), len(v), k) for k, v in edges.items()), reverse=True)
    out = [f"calls {n}; wall p50 {1e6*statistics.median(totals):.1f} us; sum of edge medians {1e6*sum(r[0] for r in rows):.1f} us"]
    for m, c, (a, b) in rows[:top]:
        out.append(f"{1e6*m:8.1f} us  x{c:<5} {a} -> {b}")
    return "\n".join(out)


def main() -> None:
    import argparse
    p = argparse.ArgumentParser(description="line-by-line timeline of 1-page Tier.put calls")
    p.add_argument("directory", help="store directory (emptied first), e.g. /dev/shm/x")
    p.add_argument("reps", type=int, nargs="?", default=600, help="timed calls (default 600)")
    p.add_argument("--top", type=int, default=110, help="statements printed, costliest first")
    p.add_argument("--get", action="store_true",
                   help="time 1-page Tier.get calls instead (of pages put first, untimed), "
                        "against a raw kvikio read of the same size")
    p.add_argument("--pool-io", action="store_true",
                   help="io_on_caller off: the tier's I/O always through kvikio's pool")
    args = p.parse_args()
    import torch
    # Each module is executed again from its rewritten source, in import order: a module that
    # imports a class from another (tier <- copiers) must come after it to get the stamped one.
    install("gdskv.backends.base", ["WaitingFuture._complete", "WaitingFuture.result", "WaitingFuture.__init__",
                                    "Backend.start"])
    install("gdskv.backends.kvikio", ["KvikioBackend._submit", "KvikioBackend._wait",
                                      "KvikioBackend.move_on_caller", "KvikioBackend._caller_context"])
    install("gdskv.launch_graphs", ["LaunchGraphs.run"])
    install("gdskv.gpu_verdicts", ["VerdictBuffers.take", "GpuVerdicts.__init__", "GpuVerdicts.plan",
                                   "GpuVerdicts.scatter", "GpuVerdicts._launches", "GpuVerdicts.read_back",
                                   "GpuVerdicts.settle"])
    install("gdskv.gpu_spill", ["GpuSpill.__init__", "GpuSpill.gather"])
    install("gdskv.pool", ["check_token_slots", "KVPool.check_token_slots", "PoolCache.get", "_leaf_tensors"])
    install("gdskv.streams", ["CallStream.enter", "current_stream", "CallStream.__init__", "CallStream.leave"])
    install("gdskv.directory", ["PageDirectory.reserve", "PageDirectory.commit", "PageDirectory.pin",
                                "PageDirectory.unpin", "PageDirectory.algorithms"])
    install("gdskv.journal", ["Journal.append"])
    install("gdskv.persistence", ["PersistentDirectory.journal_commits", "PersistentDirectory.next_seqs"])
    install("gdskv.store", ["SlabStore.sync", "SlabStore.extents"])
    install("gdskv.copiers", ["PoolCopier.prepare", "PoolCopier._use", "PoolCopier.graph_slots", "PoolCopier.__init__",
                              "DeferredCopier.__init__"])
    install("gdskv.staging", ["StagingParts.try_take", "StagingParts.give_back", "StagingParts._ready"])
    install("gdskv.admission", ["AdmissionFilter.admit"])
    install("gdskv.ledger", ["CallLedger.record", "CallLedger.settle"])
    install("gdskv.call_gate", ["CallGate.enter_shared", "CallGate.leave_shared"])
    install("gdskv.tier", ["Tier.put", "Tier._pool_copier", "Tier._copier_for", "Tier._run", "Tier._call_stream",
                           "Tier._check_keys", "Tier.get", "Tier._refuse_byte_pages"])
    install("gdskv.spill_call", ["SpillCall.run", "SpillCall._finish_write", "SpillCall._trailers",
                                 "SpillCall._writing", "SpillCall._gpu_spill"])
    install("gdskv.restore_call", ["RestoreCall.run", "RestoreCall._finish_read", "RestoreCall._unpin",
                                   "RestoreCall._gpu_verdicts", "RestoreCall._settle"])
    install("gdskv.data_call", ["CallContext.gpu_checked"])
    from gdskv.tier import Tier
    from gdskv.config import TierConfig
    from gdskv.layout import KVLayout
    from gdskv.streams import OnStream

    d, reps = args.directory, args.reps
    shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    lay = KVLayout(32, 16, 128, 8)
    tier = Tier(lay, TierConfig(directories=(d,), capacity=4 << 30, backend="kvikio" if gpu else "posix",
                                         io_on_caller=not args.pool_io), device=dev)
    N = 64
    pool = tuple(torch.randn(32, N * 16, 8, 128, device=dev).to(torch.bfloat16) for _ in range(2))
    slots = [torch.arange(p * 16, p * 16 + 16, dtype=torch.int64) for p in range(N)]
    if gpu:
        OnStream(torch.cuda.Stream(dev)).__enter__(); torch.cuda.synchronize()
    calls, walls, raws = [], [], []
    part = tier._staging[1]
    if args.get:  # the pages the gets restore, put first (untimed)
        for p in range(N):
            assert tier.put([f"g{p}"], pool, slots[p]) == [True]
    for i in range(reps + 30):
        begin(); t0 = time.perf_counter()
        if args.get:  # page i % N into the slots of another page
            tier.get([f"g{i % N}"], pool, slots[(i + 7) % N])
        else:
            tier.put([f"k{i}"], pool, slots[i % N])
        t = time.perf_counter() - t0; st = end()
        # raw: the same slot count, next free-ish slot far away
        ext = tier.store.extents([tier.store.num_slots - 1 - (i % 900)])
        t1 = time.perf_counter()
        if args.get:
            tier.backend.read(part[:lay.slot_bytes], ext).result()
        else:
            tier.backend.write(part[:lay.slot_bytes], ext).result(); os.fdatasync(tier.store.files[ext[0].file].fd)
        r = time.perf_counter() - t1
        if i >= 30:
            calls.append(st); walls.append(t); raws.append(r)
    what = "get" if args.get else "put"
    raw = "read" if args.get else "write+fdatasync"
    print(f"{what} p50 {1e6*statistics.median(walls):.1f} us, raw({raw} through kvikio's pool, rotating slots) p50 {1e6*statistics.median(raws):.1f} us")
    print(summarize(calls, top=args.top))
    tier.close()


if __name__ == "__main__":
    main()
