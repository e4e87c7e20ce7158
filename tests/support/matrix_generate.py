"""The differential matrix's generate cells (feature ``storage_cache``): one tiny model generates the same prompts
in memory with a ``DynamicCache`` and with a ``deepoffload.StorageCache`` (greedy, sampling with a seed, beam search;
5 new tokens each) under the precision's autocast; ``identical`` when every token is the same. Training loops have no
generate step (``not applicable``), nor has the plain model (not a transformers model) or ``compute_bf16`` (an
``offload_parameters`` option)."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path
from types import ModuleType

import torch

MODES = ({"do_sample": False}, {"do_sample": True, "top_k": 10}, {"do_sample": False, "num_beams": 3})


def _tokens(harness: ModuleType, model, make_cache, precision: str) -> list[float]:
    out: list[float] = []
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(7))
    for mode in MODES:
        cache = make_cache()
        try:
            torch.manual_seed(1)
            with torch.no_grad(), harness._autocast(precision):
                new = model.generate(
                    ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=5, pad_token_id=0, **mode
                )
            out += [float(t) for t in new.flatten().tolist()]
        finally:
            getattr(cache, "close", lambda: None)()
    return out


def storage_cache_cell(harness: ModuleType, name: str, precision: str, loop: str, folder: Path):
    """The outcome (``harness.Outcome``) of the generate cell ``(name, precision, loop, "storage_cache")``; ``harness``
    is the matrix harness module (passed in: it may run as a script)."""
    from transformers import DynamicCache

    from deepoffload import StorageCache

    if loop != "plain":
        return harness.Outcome("not applicable", "StorageCache is a generate cache; training loops do not generate")
    if precision == "compute_bf16":
        return harness.Outcome("not applicable", "compute_dtype= is an offload_parameters() option (StreamOptions)")
    if name == "plain":
        return harness.Outcome("not applicable", "StorageCache serves transformers models (the plain model has none)")
    folder.mkdir(parents=True, exist_ok=True)
    model = harness.build(name).eval()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            expected = _tokens(harness, model, lambda: DynamicCache(config=model.config), precision)
        except Exception as e:  # noqa: BLE001  (the combination fails in memory too)
            return harness.Outcome("in-memory fails too", harness._first_line(e))
        try:
            got = _tokens(
                harness, model, lambda: StorageCache(folder, config=model.config, flush_bytes=4096), precision
            )
        except (ValueError, RuntimeError, TypeError) as e:
            text = harness._first_line(e)
            return harness.Outcome("refused" if harness._from_deepoffload(e) else "error", text)
    if got == expected:
        return harness.Outcome("identical")
    first = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b) if len(got) == len(expected) else -1
    return harness.Outcome("differs", f"tokens differ (first at {first} of {len(expected)})")
