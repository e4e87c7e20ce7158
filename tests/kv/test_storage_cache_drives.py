"""``StorageCache(path=[a, b])``: the layers' files spread over a run folder on each drive (two loop-device ext4
drives), each drive with its own IO queue; the tokens of one folder and of ``DynamicCache``; every drive's run folder
removed at close and, after a killed generate, by the next cache."""

from __future__ import annotations

import os

import pytest
import torch

from deepoffload import StorageCache
from tests.support.drives import Drives, unavailable
from tests.support.killed import run_until_killed

from .helpers import FLUSH, dynamic_and_storage, generate, llama, prompt


@pytest.fixture
def two():
    reason = unavailable("loop")
    if reason is not None:
        pytest.skip(reason)
    with Drives(2, size=32 << 20) as drives:
        yield drives.folders


def test_layers_spread_over_two_drives_give_the_tokens_of_one_folder(two, scratch):
    model, ids = llama(), prompt()
    reference, one, _ = dynamic_and_storage(model, ids, scratch, do_sample=False, max_new_tokens=12)
    with StorageCache(two, config=model.config, flush_bytes=FLUSH) as cache:
        tokens = generate(model, ids, cache, do_sample=False, max_new_tokens=12)
        assert len(cache.folders) == 2 and [os.path.dirname(f) for f in cache.folders] == two
        per_drive = [sorted(os.listdir(folder)) for folder in cache.folders]
        assert all(any(n.startswith("layer") for n in names) for names in per_drive), per_drive  # both used
        assert sum(len([n for n in names if n.startswith("layer")]) for names in per_drive) == 2 * 3
        written = [
            sum(os.path.getsize(os.path.join(f, n)) for n in os.listdir(f) if n.startswith("layer"))
            for f in cache.folders
        ]
        assert all(w > 0 for w in written), written  # both drives were written
        handles = {id(s.handle) for s in cache._streams()}
        assert len(handles) == 2  # a queue per drive
        folders = list(cache.folders)
    assert torch.equal(one, tokens) and torch.equal(reference, tokens)
    assert not any(os.path.exists(f) for f in folders), "every drive's run folder removed at close"


def test_a_killed_generate_over_two_drives_is_cleaned_on_both_by_the_next_cache(two):
    code = (
        "import os, signal, deepoffload\n"
        "from tests.kv.helpers import generate, llama, prompt\n"
        "model = llama()\n"
        f"cache = deepoffload.StorageCache({two!r}, config=model.config, flush_bytes=4096)\n"
        "generate(model, prompt(), cache, do_sample=False, max_new_tokens=3)\n"
        "print(*cache.folders, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    left = run_until_killed(code).split()
    assert len(left) == 2 and all(os.listdir(f) for f in left)
    model, ids = llama(), prompt()
    reference, tokens, _ = dynamic_and_storage(model, ids, two, do_sample=False)
    assert not any(os.path.exists(f) for f in left), "the dead run's folders went on both drives"
    assert torch.equal(reference, tokens)
