"""Builds csrc/aio into a standalone extension (no torch headers) and smoke-tests its Python API.

Usage: python tests/native/smoke_binding.py [directory-on-a-real-disk]
Exits non-zero on failure. Uses only ctypes buffers, no tensors.
"""

import ctypes
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..", "..")
SRC = os.path.join(REPO, "csrc", "aio")
NAME = "deepoffload_aio_smoke"


def build(out_dir: str) -> None:
    import torch.utils.cpp_extension as ext  # only for the pybind11 include path

    sys.path.insert(0, REPO)
    from op_builder.async_io import AsyncIOBuilder  # the JIT build's probes and flags

    cflags, ldflags = AsyncIOBuilder().build_flags()
    sources = [
        os.path.join(SRC, f) for f in sorted(os.listdir(SRC)) if f.endswith(".cpp") and not f.endswith("_windows.cpp")
    ]
    includes = ["-I" + p for p in ext.include_paths()[:1]] + ["-I" + sysconfig.get_paths()["include"]]
    cmd = (
        ["g++", *cflags, "-Werror", "-shared", "-fPIC", "-pthread", "-DTORCH_EXTENSION_NAME=" + NAME]
        + includes
        + sources
        + ["-o", os.path.join(out_dir, NAME + sysconfig.get_config_var("EXT_SUFFIX"))]
        + ldflags
    )
    subprocess.run(cmd, check=True)


def address(buf) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def main() -> int:
    base = sys.argv[1] if len(sys.argv) > 1 else os.getcwd()
    failures = []

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory(dir=base) as work:
        build(work)
        sys.path.insert(0, work)
        m = __import__(NAME)
        engines = m.engines()
        check(engines[-1] == "posix", f"engines() = {engines}")
        feats = m.build_features()
        check(set(feats) == {"engines", "reap"} and feats["engines"] == engines, f"build_features() = {feats}")
        check(
            m.DEFAULTS
            == {
                "engine": "posix",
                "block_size": 1 << 20,
                "queue_depth": 32,
                "single_submit": False,
                "overlap_events": True,
                "intra_op_parallelism": 1,
            },
            f"DEFAULTS = {m.DEFAULTS}",
        )
        h = m.Handle()
        check({k: getattr(h, k) for k in m.DEFAULTS} == m.DEFAULTS, "Handle() takes DEFAULTS")
        h.close()
        check((m.TRUNCATE, m.BUFFERED, m.FSYNC) == (1, 2, 4), "flag constants")
        mem, off, direct = m.dio_alignment(work)
        check(mem > 0 and off > 0 and isinstance(direct, bool), f"dio_alignment(dir) = {(mem, off, direct)}")
        try:
            m.dio_alignment(os.path.join(work, "missing"))
            check(False, "dio_alignment(missing) raises")
        except FileNotFoundError:
            check(True, "dio_alignment(missing) raises FileNotFoundError")
        for bad in (dict(engine="nope"), dict(block_size=0), dict(queue_depth=0), dict(intra_op_parallelism=0)):
            args = dict(
                engine="posix",
                block_size=1 << 20,
                queue_depth=8,
                single_submit=False,
                overlap_events=True,
                intra_op_parallelism=1,
            )
            args.update(bad)
            try:
                m.Handle(**args)
                check(False, f"Handle({bad}) raises ValueError")
            except ValueError as e:
                check(next(iter(bad)) in str(e), f"Handle({bad}) raises ValueError: {e}")

        n = 1_000_003
        src = bytearray(os.urandom(n))
        path = os.path.join(work, "data.bin")
        # A 1 ms SIGALRM with a Python handler must not break any engine.
        ticks = [0]
        signal.signal(signal.SIGALRM, lambda *_: ticks.__setitem__(0, ticks[0] + 1))
        signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
        try:
            for engine in engines:
                ok, reason = m.self_test(engine, work)
                check(ok, f"self_test({engine}) = {(ok, reason)}")
                h = m.Handle(engine, 1 << 16, 8, False, True, 2)
                check(
                    (h.engine, h.block_size, h.queue_depth, h.single_submit, h.overlap_events, h.intra_op_parallelism)
                    == (engine, 1 << 16, 8, False, True, 2),
                    f"{engine} properties",
                )
                for rnd in range(20):
                    dst = bytearray(n)
                    wid = h.submit(True, address(src), n, path, -1, 777, m.TRUNCATE)
                    check(h.pending() == 1, f"{engine} pending") if rnd == 0 else None
                    res = h.wait(wid, -1)
                    if res[0] != 0 or os.path.getsize(path) != n + 777:
                        check(False, f"{engine} write {res}")
                        break
                    res = h.wait(h.submit(False, address(dst), n, path, -1, 777, 0), -1)
                    if res[0] != 0 or dst != src:
                        check(False, f"{engine} read {res}")
                        break
                else:
                    check(True, f"{engine} 20 round trips of {n} bytes under a 1 ms SIGALRM")
                res = h.wait(h.submit(False, address(dst), n, os.path.join(work, "missing"), -1, 0, 0), -1)
                check(res[0] == 2 and res[1] == "open" and res[2].endswith("missing"), f"{engine} missing: {res}")
                res = h.wait(h.submit(False, address(dst), n, path, -1, 1000, 0), 5.0)
                check(res is not None and res[0] == 61 and "ends at byte" in res[4], f"{engine} past end: {res}")
                try:
                    h.wait(12345, 0)
                    check(False, f"{engine} wait(unknown) raises ValueError")
                except ValueError:
                    check(True, f"{engine} wait(unknown) raises ValueError")
                big = bytearray(64 << 20)
                wid = h.submit(True, address(big), len(big), path, -1, 0, m.FSYNC)
                first = h.wait(wid, 0.0)
                check(first is None or first[0] == 0, f"{engine} wait(timeout=0) -> {first}")
                if first is None:
                    check(h.wait(wid, -1)[0] == 0, f"{engine} wait after timeout")
                h.close()
                h.close()
                check(h.pending() == 0, f"{engine} close idempotent")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
        check(ticks[0] > 0, f"SIGALRM handler ran {ticks[0]} times")
        # A handle dropped with an op in flight must finish it and exit cleanly.
        h = m.Handle(engines[0], 1 << 20, 32, False, True, 1)
        h.submit(True, address(src), n, path, -1, 0, 0)
        del h
    print(f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
