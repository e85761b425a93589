"""Several generations in one denoising loop: their DiT calls batched step by step.

Each request of a batch runs the ordinary pipeline (``StagedPipeline.__call__``) in its own
thread, with its own seed, prompt, negative prompt, guidance and scheduler, so everything but the
DiT is exactly what it would be alone. The DiT calls all go through
``StagedPipeline.run_branches`` (and the VAE decodes through the same rendezvous); a request of a
batch carries its membership ``(batcher, index)`` in its ``Generation``, and a call waits there
until every request of the batch has reached the same step, and then the batch's executor (the thread that called :meth:`StepBatcher.run`) runs all
of them as one call: each batched argument is concatenated branch-major (``[cond rows of every
request, uncond rows of every request]``, so CFG parallelism still splits it by branch), the output
is cut back into each request's rows. The request threads themselves only do per-request work
(scheduler steps, guidance arithmetic); every module call runs on the executor thread. A request's image therefore differs from its unbatched image only
by the GEMMs' batch-size-dependent rounding.

Order is deterministic on every rank: the requests' prologues (the broadcast of rank 0's prompt
encoding, a collective) take turns in request order, module calls with collectives before the loop
(Z-Image's caption refiner) go through the same rendezvous as the DiT calls
(``StagedPipeline.batch_call``), and a batched call concatenates the requests in request order, so tensor- and sequence-parallel ranks run the
same collectives on the same rows. Calls that cannot be concatenated (different non-batched
arguments or shapes, e.g. prompts of different lengths) run one after the other, in request
order. Requests with different LoRA compositions share a call: each call carries its request's
LoRA selection, and the batched call gives every row its own request's adapters
(:mod:`.lora_rows`). Decoding is one call for the batch too, which also keeps two decodes from
running at once (some VAEs keep a causal-convolution cache on the module while decoding).

Continuous batching (:meth:`StepBatcher.run` with ``admit``): a batch is not fixed when it starts.
At every step boundary (every request of the batch waits at a module call, none of them runs) the
executor asks ``admit`` for new requests; each one JOINS as the next request index, starts its
thread, and its first module calls (its prompt encoding, then its first DiT step) meet the
running requests' next calls. A joined request is usually at another denoising step than the
others: every family passes its timestep as a batched argument (one value per row, ``[B]`` or
``[B, tokens]``), so its DiT call still concatenates with theirs when the other arguments line
up (same size, frames, CFG layout, denoiser), and runs beside them in the same step when they do
not. A request that finishes LEAVES: its decode is one more call at the next boundary, then its
body returns (the caller hands its result out at once) while the others go on. The batch ends
when no request is left and ``admit`` gives none.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch


class _Call:
    def __init__(self, index, run, denoiser, rows, args, batched, lora):
        self.index, self.run, self.denoiser = index, run, denoiser
        self.rows, self.args, self.batched = rows, args, batched
        self.lora = lora  # the request's LoRA selection (None: the layers' active ones)
        # grad mode is per thread: the batch's executor thread runs the call outside the
        # request's pipeline (and its no_grad)
        self.grad = torch.is_grad_enabled()
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None


class _BatchInterrupted(RuntimeError):
    """What the request threads of a batch get when its executor was interrupted."""


class StepBatcher:
    """Lock-step rendezvous of ``n`` request threads (see the module docstring).

    :meth:`run` starts the request threads and runs every batched call itself, on the calling
    thread: all the heavy tensor work of a batch stays on one OS thread. That is not a detail on
    the CPU. OpenMP (libgomp) keeps a thread team per thread that ever ran a parallel region, and
    once more threads are managed than there are cores it stops spinning between regions: every
    elementwise op then pays a futex wake-up (measured on 2 cores: 34 -> 80 us for a 786k-float
    multiply, a DiT call of 16 rows 20 -> 27 ms when run from a second thread).

    Args:
        n: requests in the batch (request ``i`` is ``bodies[i]`` of :meth:`run`).
        shared: with several ranks, the modules every rank calls (the denoisers): ``admit`` is
            then asked only at the step boundaries where one of them is called (and when no
            request is left), the boundaries every rank has in the same order; rank 0's own
            calls (text encoding, decoding) make boundaries of their own that the other ranks
            do not have. ``None`` (one process): at every boundary.
    """

    def __init__(self, n: int, shared: Sequence[Any] | None = None):
        lock = threading.Lock()
        self.cv = threading.Condition(lock)  # request threads: their call is done, turns
        self.ready = threading.Condition(lock)  # the executor: a step is complete
        self.n = n
        self.active = set(range(n))
        self.pending: dict[int, _Call] = {}
        self.turn = 0  # the request whose prologue may run now
        self.prologued: set[int] = set()
        self.broken = False  # the executor left (interrupted): every wait and call fails
        self.shared = None if shared is None else {id(m) for m in shared}

    def run(
        self,
        bodies: list[Callable[[], None]],
        admit: Callable[[int], Sequence[Callable[[int], None]]] | None = None,
    ) -> None:
        """Run ``bodies[i]`` as request ``i``, each in its own thread, and their module calls
        (:meth:`submit`) on this thread, step by step; return when every body returned (and
        ``admit`` gave no more). A body's exception is its own business: catch it inside the
        body.

        Args:
            admit: continuous batching (see the module docstring): called on this thread at
                each step boundary, and once more when every request has left, with the number
                of requests in the batch; returns the bodies of the requests that join now
                (possibly none), each called with its request index. It runs under the
                batcher's lock: it must be quick and must not wait for the batch.
        """
        if len(bodies) != self.n:
            raise ValueError(f"{self.n} requests, {len(bodies)} bodies")
        threads = [
            threading.Thread(target=self._body, args=(i, b), name=f"batch-request-{i}")
            for i, b in enumerate(bodies)
        ]
        try:
            for t in threads:
                t.start()
            with self.cv:
                asked = False  # admit was asked at this step boundary
                while True:
                    ready = self._step_ready_locked()
                    if admit is not None and not asked and self._admits_now_locked(ready):
                        asked = True
                        self._admit_locked(admit, threads)
                    elif ready:
                        self._run_step_locked()
                        asked = False
                    elif not self.active:
                        break
                    else:
                        self.ready.wait()
        except BaseException:  # e.g. Ctrl-C: release every request thread, then re-raise
            with self.cv:
                self.broken = True
                for c in self.pending.values():
                    c.error, c.done = _BatchInterrupted("the batch was interrupted"), True
                self.pending = {}
                self.cv.notify_all()
            raise
        finally:
            for t in threads:
                if t.ident is not None:  # started
                    t.join()

    def _admits_now_locked(self, ready: bool) -> bool:
        """Whether this is a boundary where ``admit`` is asked (see ``shared``)."""
        if not self.active:
            return True
        if not ready:
            return False
        return self.shared is None or any(
            id(c.denoiser) in self.shared for c in self.pending.values()
        )

    def _admit_locked(
        self,
        admit: Callable[[int], Sequence[Callable[[int], None]]],
        threads: list[threading.Thread],
    ) -> None:
        """Start the requests ``admit`` gives as the next request indices (they are members,
        so the next step waits for their first call)."""
        threads[:] = [t for t in threads if t.is_alive() or t.ident is None]
        for body in admit(len(self.active)):
            index = self.n
            self.n += 1
            self.active.add(index)
            t = threading.Thread(
                target=self._body,
                args=(index, functools.partial(body, index)),
                name=f"batch-request-{index}",
            )
            threads.append(t)
            t.start()

    def _body(self, index: int, body: Callable[[], None]) -> None:
        with self.member(index):
            body()

    @contextmanager
    def member(self, index: int) -> Iterator[None]:
        """Run the body as request ``index`` of the batch (its pipeline call gets
        ``batch=(batcher, index)``); leaving releases the others."""
        try:
            yield
        finally:
            with self.cv:
                self.active.discard(index)
                self.prologued.add(index)  # a request that failed early gives up its turn
                self._advance_turn_locked()
                self.cv.notify_all()
                self.ready.notify()

    @contextmanager
    def prologue(self, index: int) -> Iterator[None]:
        """Wait for request ``index``'s turn (request order), run the body, pass the turn on."""
        with self.cv:
            while self.turn != index and not self.broken:
                self.cv.wait()
            if self.broken:
                raise _BatchInterrupted("the batch was interrupted")
        try:
            yield
        finally:
            with self.cv:
                self.prologued.add(index)
                self._advance_turn_locked()
                self.cv.notify_all()

    def _advance_turn_locked(self) -> None:
        while self.turn < self.n and self.turn in self.prologued:
            self.turn += 1

    def submit(
        self, index: int, run: Callable, denoiser, rows: int, args: dict, batched, lora=None
    ) -> Any:
        """Request ``index``'s module call ``run(module, rows, args, batched, row_lora)``;
        returns its own output once the step's batch ran (on the thread in :meth:`run`).

        Args:
            lora: the request's LoRA selection; the batched call's ``row_lora`` gives each row
                its own request's.
        """
        call = _Call(index, run, denoiser, rows, args, tuple(batched), lora)
        with self.cv:
            if self.broken:
                raise _BatchInterrupted("the batch was interrupted")
            self.pending[index] = call
            if self._step_ready_locked():
                self.ready.notify()
            while not call.done and not self.broken:
                self.cv.wait()
            if not call.done:
                raise _BatchInterrupted("the batch was interrupted")
        if call.error is not None:
            raise call.error
        return call.result

    def _step_ready_locked(self) -> bool:
        return bool(self.pending) and set(self.pending) == self.active

    def _run_step_locked(self) -> None:
        calls = [self.pending[i] for i in sorted(self.pending)]
        if self.shared is not None:
            # the calls every rank makes first, among themselves: a rank-0-only call (a
            # decode) between two of them would split their group on rank 0 alone, and the
            # ranks would run collectives of different sizes
            calls.sort(key=lambda c: id(c.denoiser) not in self.shared)
        self.pending = {}
        try:
            for group in _groups(calls):
                try:
                    with torch.set_grad_enabled(group[0].grad):  # the same in every request
                        if len(group) == 1:
                            c = group[0]
                            n = _rows_of(c.args[c.batched[0]]) if c.batched else 0
                            c.result = c.run(c.denoiser, c.rows, c.args, c.batched, [c.lora] * n)
                        else:
                            _run_group(group)
                except Exception as e:  # the group's requests fail with its error, no others
                    for c in group:
                        c.error = e
        except BaseException:  # interrupted (Ctrl-C): the whole step fails, run() re-raises
            for c in calls:
                c.error = _BatchInterrupted("the batch was interrupted")
            raise
        finally:
            for c in calls:
                c.done = True
            self.cv.notify_all()


def branch_rows(value: Any, index: int, rows: int) -> Any:
    """Branch ``index`` of ``rows`` branches stacked along dim 0 (a tensor, a list, or a sized
    object with ``select(index_list)``)."""
    if isinstance(value, torch.Tensor):
        return value.chunk(rows, 0)[index]
    n = len(value)
    lo, hi = index * n // rows, (index + 1) * n // rows
    return value[lo:hi] if isinstance(value, list) else value.select(list(range(lo, hi)))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    return a == b


def _row_shape(v: Any) -> tuple | None:
    return tuple(v.shape[1:]) if isinstance(v, torch.Tensor) else None


def _compatible(a: _Call, b: _Call) -> bool:
    if a.denoiser is not b.denoiser or a.rows != b.rows or a.batched != b.batched:
        return False
    if set(a.args) != set(b.args):
        return False
    for k, v in a.args.items():
        if k in a.batched:
            w = b.args[k]
            if type(v) is not type(w) or _row_shape(v) != _row_shape(w):
                return False
        elif not _same(v, b.args[k]):
            return False
    return True


def _groups(calls: list[_Call]) -> list[list[_Call]]:
    """Consecutive runs of calls that can share one DiT call (request order kept)."""
    groups: list[list[_Call]] = []
    for c in calls:
        if groups and _compatible(groups[-1][0], c):
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def _concat(values: list) -> Any:
    v0 = values[0]
    if isinstance(v0, torch.Tensor):
        return torch.cat(values, 0)
    if isinstance(v0, list):
        return [x for v in values for x in v]
    return type(v0).concat(values)  # e.g. Z-Image's caption context


def _rows_of(value: Any) -> int:
    return int(value.shape[0]) if isinstance(value, torch.Tensor) else len(value)


def _run_group(group: list[_Call]) -> None:
    c0 = group[0]
    rows = c0.rows
    sizes: list[int] = []
    args = dict(c0.args)
    for k in c0.batched:
        parts = [[branch_rows(c.args[k], r, rows) for c in group] for r in range(rows)]
        if not sizes:
            sizes = [len(p) for p in parts[0]]
        args[k] = _concat([p for branch in parts for p in branch])
    # the LoRA selection of every row of the batched call, in its row order (branch-major, then
    # request order)
    row_lora = [c.lora for _ in range(rows) for c, n in zip(group, sizes) for _ in range(n)]
    out = c0.run(c0.denoiser, rows, args, c0.batched, row_lora)
    total = sum(sizes)
    for i, c in enumerate(group):
        lo = sum(sizes[:i])
        if isinstance(out, (list, torch.Tensor)):
            pieces = [out[r * total + lo : r * total + lo + sizes[i]] for r in range(rows)]
            c.result = (
                [x for p in pieces for x in p] if isinstance(out, list) else torch.cat(pieces)
            )
        else:  # an object with select (Z-Image's caption context)
            c.result = out.select(
                [r * total + lo + j for r in range(rows) for j in range(sizes[i])]
            )
