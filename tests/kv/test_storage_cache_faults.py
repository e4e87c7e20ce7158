"""``StorageCache`` under bad input: a full disk (the keys and values stay in memory, the next forward raises with
path and errno, then goes on exactly), tmpfs (a warning) and a file system without O_DIRECT (buffered), two threads
(one at a time; a cache each works), a crashed run's files (removed by the next run, also after a generate killed
mid-way)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from transformers import DynamicCache

import deepoffload
from deepoffload import StorageCache, UnsupportedError
from tests.support.killed import run_until_killed

from .helpers import FLUSH, dynamic_and_storage, generate, llama, prompt

MiB = 1 << 20


def forwards(model, ids, cache, steps):
    """Logits of a prefill of ``ids`` then ``steps`` one-token forwards (each the prefill's argmax, fixed)."""
    out = []
    with torch.no_grad():
        logits = model(ids, cache=cache, use_cache=True).logits[:, -1]
        out.append(logits)
        token = logits.argmax(-1, keepdim=True)
        for _ in range(steps):
            out.append(model(token, cache=cache, use_cache=True).logits[:, -1])
    return out


def test_full_disk_keeps_the_tokens_in_memory_raises_then_goes_on_exactly(small_fs):
    folder = small_fs(3 * MiB, "ext4")
    model, ids = llama(layers=2, head_dim=64, kv_heads=4), prompt(batch=1, tokens=1200)  # 4.9 MiB of keys and values
    with torch.no_grad():
        reference = forwards(model, ids, DynamicCache(config=model.config), 2)
        cache = StorageCache(folder, config=model.config, flush_bytes=64 << 10)
        first = model(ids, cache=cache, use_cache=True).logits[:, -1]
        token = first.argmax(-1, keepdim=True)
        with pytest.raises(OSError) as info:
            model(token, cache=cache, use_cache=True)
        error = info.value
        assert error.errno == errno.ENOSPC and error.filename.startswith(cache.folder), error
        assert "at offset" in str(error) and "stay in memory" in str(error), error
        assert cache.get_seq_length() == 1200 and cache.stats()["bytes_in_memory"] > 0
        steps = [first] + [model(token, cache=cache, use_cache=True).logits[:, -1] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(reference, steps))
    cache.close()
    assert not [name for name in os.listdir(folder) if name.startswith("deepoffload-")]


def test_tmpfs_warns_and_gives_the_same_tokens(small_fs):
    folder = small_fs(64 * MiB, "tmpfs")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference, tokens, stats = dynamic_and_storage(llama(), prompt(), folder)
    assert torch.equal(reference, tokens) and stats["bytes_written"] > 0
    assert any("tmpfs" in str(w.message) for w in caught)


def test_a_file_system_without_o_direct_is_read_buffered(small_fs):
    folder = small_fs(0, "ramfs")
    reference, tokens, stats = dynamic_and_storage(llama(), prompt(), folder)
    assert torch.equal(reference, tokens) and stats["bytes_read"] > 0


def test_an_update_from_a_second_thread_while_one_runs_is_refused(scratch, monkeypatch):
    model, ids = llama(), prompt()
    entered, release = threading.Event(), threading.Event()
    original = deepoffload.kv.layer.StorageLayer.past_and_new

    def slow(self, *args):
        entered.set()
        release.wait(60)
        return original(self, *args)

    with StorageCache(scratch, config=model.config, flush_bytes=FLUSH) as cache:
        generate(model, ids, cache, do_sample=False, max_new_tokens=2)
        monkeypatch.setattr(deepoffload.kv.layer.StorageLayer, "past_and_new", slow)
        k = torch.zeros(2, 2, 1, 16)
        thread = threading.Thread(target=cache.update, args=(k, k, 1))
        thread.start()
        assert entered.wait(60)
        with pytest.raises(UnsupportedError, match="two threads"):
            cache.update(k, k, 1)
        release.set()
        thread.join()
        assert cache.layers[1].get_seq_length() == 22  # the first thread's update went through, once


def test_two_threads_each_with_a_cache_of_its_own(scratch):
    model = llama()
    ids = [prompt(seed=i) for i in range(2)]
    reference = [generate(model, x, DynamicCache(config=model.config), do_sample=False) for x in ids]
    results: dict[int, object] = {}

    def run(i):
        try:
            with StorageCache(scratch, config=model.config, flush_bytes=FLUSH) as cache:
                results[i] = generate(model, ids[i], cache, do_sample=False)
        except BaseException as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert isinstance(results[i], torch.Tensor), results[i]
        assert torch.equal(reference[i], results[i])


def test_a_crashed_runs_files_are_removed_by_the_next_cache(scratch):
    code = (
        "import os, signal, deepoffload\n"
        "from tests.kv.helpers import generate, llama, prompt\n"
        "model = llama()\n"
        f"cache = deepoffload.StorageCache({str(scratch)!r}, config=model.config, flush_bytes=4096)\n"
        "generate(model, prompt(), cache, do_sample=False, max_new_tokens=3)\n"
        "print(cache.folder, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    left = run_until_killed(code).strip()
    assert os.path.getsize(os.path.join(left, "layer0.keys")) > 0
    with StorageCache(scratch, config=llama().config):
        assert not os.path.exists(left), "the dead run's files went when the next cache was made"


def test_a_generate_killed_mid_way_leaves_files_the_next_run_removes_and_it_is_exact(scratch):
    """A generate SIGKILLed inside a decoded token's forward, right after a write was submitted (not yet settled:
    in flight), leaves its run folder; the next StorageCache in the same folder removes it, and its generate gives
    DynamicCache's tokens."""
    code = (
        "import os, signal, deepoffload\n"
        "from deepoffload.kv.stream import ByteStream\n"
        "from tests.kv.helpers import generate, llama, prompt\n"
        "flush = ByteStream._flush\n"
        "def dying(self):\n"
        "    flush(self)\n"
        "    if self.writing is not None and cache.get_seq_length() > 20 + 3:\n"  # past the prompt and 3 tokens
        "        print(cache.folder, cache.get_seq_length(), flush=True)\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "ByteStream._flush = dying\n"
        "model = llama()\n"
        f"cache = deepoffload.StorageCache({str(scratch)!r}, config=model.config, flush_bytes=4096)\n"
        "generate(model, prompt(), cache, do_sample=False, max_new_tokens=40)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left, tokens_then = proc.stdout.split()
    assert 23 < int(tokens_then) < 60, "killed mid-way through the decoded tokens"
    assert {"layer0.keys", "layer0.values"} <= set(os.listdir(left))
    assert os.path.getsize(os.path.join(left, "layer0.keys")) > 0
    model, ids = llama(), prompt()
    reference, tokens, _ = dynamic_and_storage(model, ids, scratch, do_sample=False)
    assert not os.path.exists(left), "the dead run's files went when the next cache was made"
    assert torch.equal(reference, tokens)
    assert os.listdir(scratch) == [], "and the next run's own at its close"
