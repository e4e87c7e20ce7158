"""The guided search behind ``deepoffload tune``: coordinate descent over the async-IO knobs within a time budget.

Starting from a config, each knob in turn is varied around the best config so far (ordered knobs climb one step at a
time in the direction that helps; the others try every value) and passes repeat until none changes anything. Then the
leaders are measured again, interleaved, and ranked by their median, so one lucky measurement does not win. No trial
starts when it would end after the budget (judged by the longest trial so far); the first trial always runs.

The score is the combined read+write throughput: the harmonic mean of write and read GB/s, which is the rate of a
write followed by a read of the same bytes (bytes moved / time taken), as swapping does.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..config import AioConfig

SCORE_DESCRIPTION = "combined read+write: harmonic mean of write and read GB/s (1e9 bytes/s)"
BLOCK_SIZES = tuple(1 << k for k in range(17, 24))  # 128 KiB .. 8 MiB
QUEUE_DEPTHS = (4, 8, 16, 32, 64, 128)
THREADS = (1, 2, 4)
SUBMIT_MODES = (
    {"single_submit": False, "overlap_events": True},
    {"single_submit": False, "overlap_events": False},
    {"single_submit": True, "overlap_events": True},
    {"single_submit": True, "overlap_events": False},
)


@dataclass(frozen=True)
class Knob:
    """A setting to vary: each value is a dict of config changes. ``ordered`` values are climbed step by step.

    Attributes:
        name: The knob's name in the output (``block_size``, ``submit``, ...).
        values: The values to try, each a dict of ``AioConfig`` field changes.
        ordered: True: the values are climbed one step at a time; False: every value is tried.
    """

    name: str
    values: tuple[dict[str, Any], ...]
    ordered: bool

    def index(self, config: AioConfig) -> int | None:
        """The position of ``config``'s value among ``values``.

        Args:
            config: The config to place.

        Returns:
            The index of the first value whose changes ``config`` already has, or None when none matches.
        """
        for i, change in enumerate(self.values):
            if all(getattr(config, k) == v for k, v in change.items()):
                return i
        return None


def default_knobs(engines: Sequence[str], nbytes: int) -> tuple[Knob, ...]:
    """Block size (up to ``nbytes``), queue depth, threads, submit mode and ``engines``, in the order searched.

    Args:
        engines: The engines to try.
        nbytes: The transfer size: larger block sizes are left out (the smallest stays).

    Returns:
        The knobs.
    """

    def ordered(name: str, key: str, values: Sequence[int]) -> Knob:
        return Knob(name, tuple({key: v} for v in values), True)

    blocks = [b for b in BLOCK_SIZES if b <= nbytes] or [BLOCK_SIZES[0]]
    return (
        ordered("block_size", "block_size", blocks),
        ordered("queue_depth", "queue_depth", QUEUE_DEPTHS),
        ordered("threads", "intra_op_parallelism", THREADS),
        Knob("submit", SUBMIT_MODES, False),
        Knob("engine", tuple({"engine": e} for e in engines), False),
    )


def combined_score(write_gbps: float, read_gbps: float) -> float:
    """Harmonic mean of the two throughputs (GB/s)."""
    return 2.0 / (1.0 / write_gbps + 1.0 / read_gbps)


@dataclass(frozen=True)
class Trial:
    """One measurement of ``config``: throughputs in GB/s, ``seconds`` of wall time, ``phase`` search or repeat.

    Attributes:
        config: The config measured.
        write_gbps: The write throughput (GB/s).
        read_gbps: The read throughput (GB/s).
        seconds: The trial's wall time.
        phase: ``search`` (the descent) or ``repeat`` (re-measuring the leaders).
    """

    config: AioConfig
    write_gbps: float
    read_gbps: float
    seconds: float
    phase: str

    @property
    def score(self) -> float:
        """The combined score: harmonic mean of the write and read throughput (GB/s)."""
        return combined_score(self.write_gbps, self.read_gbps)


@dataclass
class SearchResult:
    """The outcome of a search.

    Attributes:
        best: The winning config.
        best_write_gbps: The median write throughput (GB/s) of the best config's trials.
        best_read_gbps: The median read throughput (GB/s) of the best config's trials.
        best_score: The best config's median combined score.
        trials: Every trial, in the order they ran.
        elapsed_s: Seconds from the start to the end of the search.
        budget_s: The time budget in seconds.
        stopped: ``converged`` or ``budget``.
    """

    best: AioConfig
    best_write_gbps: float  # medians over the best config's trials
    best_read_gbps: float
    best_score: float
    trials: list[Trial]
    elapsed_s: float
    budget_s: float
    stopped: str  # "converged" or "budget"


class _OutOfTime(Exception):
    pass


Measure = Callable[[AioConfig], tuple[float, float]]


class Search:
    """Coordinate descent of ``measure`` (config -> (write GB/s, read GB/s)) over ``knobs`` from ``start``.

    ``budget_s`` counts from ``started`` (a ``clock()`` reading; default now). The descent may use up to
    ``search_share`` of it; the rest goes to re-measuring the ``leaders`` best configs up to ``repeats`` times each.

    Args:
        measure: Measures a config: returns (write GB/s, read GB/s).
        start: The config the descent starts from.
        knobs: The settings to vary, in the order searched.
        budget_s: The time budget in seconds (positive).
        clock: The clock the budget is measured with.
        started: The ``clock()`` reading the budget counts from (default: now).
        leaders: How many of the best configs are re-measured.
        repeats: How many trials each leader gets, at most.
        search_share: The share of the budget the descent may use.
        on_trial: Called with each trial as soon as it ran.

    Attributes:
        trials: Every trial so far, in the order they ran.

    Raises:
        ValueError: When ``budget_s`` is not positive.
    """

    def __init__(
        self,
        measure: Measure,
        start: AioConfig,
        knobs: Sequence[Knob],
        budget_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        started: float | None = None,
        leaders: int = 3,
        repeats: int = 5,
        search_share: float = 0.7,
        on_trial: Callable[[Trial], None] | None = None,
    ):
        if budget_s <= 0:
            raise ValueError(f"budget must be a positive number of seconds, got {budget_s}")
        self._measure = measure
        self._start = start
        self._knobs = tuple(knobs)
        self._budget = float(budget_s)
        self._clock = clock
        self._started = clock() if started is None else started
        self._leaders = leaders
        self._repeats = repeats
        self._search_share = search_share
        self._on_trial = on_trial
        self.trials: list[Trial] = []

    # -- time ----------------------------------------------------------------------------------------------------
    def _elapsed(self) -> float:
        return self._clock() - self._started

    def _fits(self, share: float) -> bool:
        longest = max((t.seconds for t in self.trials), default=0.0)
        return self._elapsed() + longest <= self._budget * share

    # -- measuring -----------------------------------------------------------------------------------------------
    def _run_trial(self, config: AioConfig, phase: str, share: float) -> None:
        if self.trials and not self._fits(share):
            raise _OutOfTime
        begin = self._clock()
        write_gbps, read_gbps = self._measure(config)
        trial = Trial(config, write_gbps, read_gbps, self._clock() - begin, phase)
        self.trials.append(trial)
        if self._on_trial is not None:
            self._on_trial(trial)

    def _of(self, config: AioConfig) -> list[Trial]:
        return [t for t in self.trials if t.config == config]

    def _score(self, config: AioConfig) -> float:
        """Median score of ``config``, measuring it first if it never was."""
        if not self._of(config):
            self._run_trial(config, "search", self._search_share)
        return statistics.median(t.score for t in self._of(config))

    # -- the search ----------------------------------------------------------------------------------------------
    def _vary(self, knob: Knob, best: AioConfig) -> AioConfig:
        def variant(i: int) -> AioConfig:
            return dataclasses.replace(best, **knob.values[i])

        here = knob.index(best)
        if not knob.ordered or here is None:
            candidates = [variant(i) for i in range(len(knob.values)) if i != here]
            return max([best, *candidates], key=self._score)
        for step in (1, -1):
            moved = False
            i = here + step
            while 0 <= i < len(knob.values) and self._score(variant(i)) > self._score(best):
                best, moved = variant(i), True
                i += step
            if moved:
                break
        return best

    def _descend(self, best: AioConfig) -> AioConfig:
        self._score(best)
        changed = True
        while changed:
            changed = False
            for knob in self._knobs:
                better = self._vary(knob, best)
                changed = changed or better != best
                best = better
        return best

    def _repeat_leaders(self, found: AioConfig) -> None:
        """Measure ``found`` (where the descent ended) and the next best configs again, interleaved."""
        ranked = sorted(dict.fromkeys(t.config for t in self.trials), key=self._score, reverse=True)
        leaders = list(dict.fromkeys([found, *ranked]))[: self._leaders]
        for _ in range(self._repeats):
            for config in leaders:  # interleaved: A B C A B C
                if len(self._of(config)) < self._repeats:
                    self._run_trial(config, "repeat", 1.0)

    def _leader(self) -> AioConfig:
        """The best median among configs measured more than once (else among all): one lucky trial never wins."""
        measured = list(dict.fromkeys(t.config for t in self.trials))
        repeated = [c for c in measured if len(self._of(c)) > 1]
        return max(repeated or measured, key=self._score)

    def run(self) -> SearchResult:
        """Descend, re-measure the leaders, and descend again from the leader until the descent stays there.

        It also stops when the budget is spent.

        Returns:
            The best config (the best median among configs measured more than once), its throughputs and the trials.
        """
        best, stopped = self._start, "converged"
        while stopped == "converged":
            found = best
            try:
                found = self._descend(best)
            except _OutOfTime:  # the descent's share is spent; the rest of the budget still goes to the leaders
                stopped = "budget"
            try:
                self._repeat_leaders(found)
            except _OutOfTime:
                stopped = "budget"
            leader = self._leader()
            if leader == best == found:
                break
            best = leader
        best = self._leader()
        mine = self._of(best)
        return SearchResult(
            best,
            statistics.median(t.write_gbps for t in mine),
            statistics.median(t.read_gbps for t in mine),
            self._score(best),
            self.trials,
            self._elapsed(),
            self._budget,
            stopped,
        )
