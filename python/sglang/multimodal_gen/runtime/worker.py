"""The TP worker process of :class:`~sglang.multimodal_gen.runtime.engine.DiffusionEngine`.

Each of the N workers builds its :class:`~sglang.multimodal_gen.runtime.runner.ModelRunner` and
then loops: rank 0 takes the next command from the engine's queue (or a no-op heartbeat while
idle), reads the LoRA files it names, broadcasts it on the CPU control group, every rank executes
it, and the outcomes are gathered so that an error on any rank reaches the caller with its type.
Errors cross the process boundary as plain dicts (:mod:`.error_transport`).

Continuous batching (a ``generate_batch`` command marked ``continuous``): at every step boundary of
the loop rank 0 asks the engine for the requests that join now (``("admit", True, running)`` on
the result queue, answered ``("admitted", requests)`` on the command queue), selects their
adapters and broadcasts them, so every rank admits the same requests at the same step
(:class:`ContinuousLink`); each finished request's result goes to the engine at once
(``("done", ok, (index, payload))``), before the command's own ``("result", ...)``.
"""

from __future__ import annotations

import logging
import queue as queue_mod

import torch

from sglang.multimodal_gen.errors import EngineDeadError
from sglang.multimodal_gen.runtime.error_transport import first_error, pack_error
from sglang.multimodal_gen.runtime.runner import ModelRunner

logger = logging.getLogger(__name__)

__all__ = [
    "ContinuousLink",
    "exit_with_parent",
    "quiet_library_progress_bars",
    "tp_worker_main",
]


# ---------------------------------------------------------------------- TP worker process
def quiet_library_progress_bars() -> None:
    """Hide transformers'/diffusers' weight-loading bars (our denoising bar stays, and so do
    ``huggingface_hub``'s download bars, unless ``HF_HUB_DISABLE_PROGRESS_BARS=1``)."""
    try:
        import diffusers.utils.logging as dlog
        import transformers.utils.logging as tlog

        tlog.disable_progress_bar()  # this also turns huggingface_hub's bars off...
        dlog.disable_progress_bar()
        # e.g. "CLIPImageProcessor requires torchvision": optional-backend notices about classes
        # we never use, printed while diffusers resolves component classes
        tlog.set_verbosity_error()
    except Exception:  # a missing or changed helper only costs some console noise
        pass
    try:  # ... which show a Hub download's progress: back on, as the library's setting says
        from huggingface_hub import constants
        from huggingface_hub.utils import enable_progress_bars

        if constants.HF_HUB_DISABLE_PROGRESS_BARS is not True:
            enable_progress_bars()
    except Exception:
        pass


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Exit this process (code 1) once its parent is gone.

    A worker ignores SIGTERM/SIGINT and may be blocked in a collective, so when the launcher
    dies without sending ``shutdown`` (SIGKILL, a crash, SIGTERM to it alone) nothing else would
    end it: it would keep its GPU memory and ports as an orphan. A daemon thread compares
    ``os.getppid()`` with the parent at start every ``poll_s`` seconds (portable, unlike
    ``PR_SET_PDEATHSIG``, and not tied to the thread that started the process).
    """
    import multiprocessing
    import os
    import threading
    import time

    # the launcher's pid as multiprocessing recorded it at spawn: getppid() here could already
    # be init's, had the launcher died while this process was still importing torch
    launcher = multiprocessing.parent_process()
    parent = launcher.pid if launcher is not None else os.getppid()
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def tp_worker_main(
    rank,
    plan,
    backend,
    runner_kwargs,
    cmd_q,
    res_q,
    heartbeat_s,
    worker_setup=None,
    fp=None,
    steps=None,
):
    """One TP rank: join the group of ``plan`` (a ``LaunchPlan``), build the runner, then lead
    (rank 0: commands from ``cmd_q``) or follow (every other rank, possibly on another node).

    The first rank of each launcher reports on ``res_q``: ``("ready", ok, info | (rank, error))``
    once the model is loaded everywhere; rank 0 then one ``("result", ...)`` per command; the
    first rank of a follower launcher ``("stopped", ok, None | (rank, error))`` when it leaves
    (``ok``: rank 0 sent ``shutdown``).
    """
    import torch.distributed as dist

    from sglang.multimodal_gen.distributed import (
        ParallelLayout,
        get_tp_cpu_group,
        init_worker,
        shutdown_worker,
    )

    # N workers would each print the same loading bars; the parent reports progress instead
    quiet_library_progress_bars()
    # the launcher owns this process's lifetime (a "shutdown" command, else SIGKILL): a Ctrl-C
    # or a SIGTERM sent to the whole process group (torchrun does) must not kill one rank early
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_with_parent()
    world = plan.world_size
    reporter = rank == plan.ranks[0]
    try:
        init_worker(
            rank, world, 0, backend, layout=runner_kwargs.get("layout"), plan=plan, fingerprint=fp
        )
    except BaseException as e:
        res_q.put(("ready", False, (rank, pack_error(e))))
        return

    def gather(obj):
        out = [None] * world
        dist.all_gather_object(out, obj, group=get_tp_cpu_group())
        return out

    try:
        runner, err = None, None
        try:
            device = runner_kwargs.pop("device")
            if torch.device(device).type == "cuda":
                device = f"cuda:{plan.device_index(rank)}"
            runner_kwargs.setdefault("layout", ParallelLayout(tp_size=world))
            runner = ModelRunner(device=device, rank=rank, **runner_kwargs)
            if steps is not None and rank == 0:  # the launcher watches rank 0's steps
                runner.steps = steps
            if worker_setup is not None:
                worker_setup(runner, rank)
        except BaseException as e:
            err = pack_error(e)
        errs = gather(err)
        failed = first_error(errs)
        if reporter:
            res_q.put(("ready", failed is None, failed if failed else runner.info()))
        if failed:
            return
        stopped = _follow_commands(rank, runner, cmd_q, res_q, heartbeat_s, gather)
        if reporter and rank != 0:
            res_q.put(("stopped", stopped is None, stopped))
    except BaseException as e:  # lost contact with another rank: say so, then exit non-zero
        if reporter and rank != 0:
            res_q.put(("stopped", False, (rank, pack_error(e))))
        raise
    finally:
        shutdown_worker()


class ContinuousLink:
    """The ``admit`` and ``on_done`` of one continuous ``generate_batch`` on one rank
    (:meth:`ModelRunner.cmd_generate_batch`), called on the loop's executor thread.

    Rank 0 asks the engine (the result queue out, the command queue back) and broadcasts what
    it got with rank 0's adapter selections; the other ranks receive the broadcast, so every rank
    admits the same requests at the same step boundary (the loop asks once per boundary on
    every rank: the boundaries follow the requests, which are the same everywhere). A message
    other than ``admitted`` on the command queue (``shutdown``, or the next command of an engine
    whose caller was interrupted) admits nothing and is kept in :attr:`held` for the command
    loop to run next.

    Attributes:
        held: the command that arrived instead of an answer (``None``: none).
    """

    def __init__(self, rank: int, runner, cmd_q, res_q, broadcast, answer_timeout_s: float):
        self.rank, self.runner = rank, runner
        self.cmd_q, self.res_q, self.broadcast = cmd_q, res_q, broadcast
        self.answer_timeout_s = answer_timeout_s
        self.held = None
        self.awaiting = False  # a question the engine has not answered yet

    def admit(self, running: int) -> list:
        """The ``(params, selection, conditioning)`` triples that join now, the same on every
        rank: rank 0 selects the adapters and encodes the prompt
        (``pipeline.encode_for_join``; a refused selection is not encoded, a failed encoding
        fails the request on every rank). Rank 0 always reaches the broadcast: an answer that
        does not come within ``answer_timeout_s`` (an engine caller interrupted mid-loop) admits
        nothing now and is read at the next boundary (an interrupted engine answers it with no
        requests when it is next called)."""
        items = None
        if self.rank == 0:
            items = []
            try:
                msg = self._answer(running)
            except Exception:  # never leave the other ranks waiting in the broadcast
                logger.exception("continuous batching: no answer from the engine; none join")
                msg = None
            if msg is not None and msg[0] == "admitted":
                for params in msg[1]:  # each one joins or is answered as refused, never dropped
                    sel, cond = None, None
                    try:
                        sel = self.runner._selections([params])[0]
                        if not isinstance(sel, tuple):  # not refused: encode
                            cond = self.runner.pipeline.encode_for_join(params, sel)
                    except Exception as e:
                        sel, cond = (False, pack_error(e)), None
                    items.append((params, sel, cond))
            elif msg is not None:
                self.held = msg
        return self.broadcast(items)

    def _answer(self, running: int):
        """The engine's answer to this boundary's question (``None``: none in time, or a
        command is held)."""
        if self.held is not None:
            return None
        if not self.awaiting:
            self.res_q.put(("admit", True, running))
            self.awaiting = True
        try:
            msg = self.cmd_q.get(timeout=self.answer_timeout_s)
        except queue_mod.Empty:
            return None
        self.awaiting = False
        return msg

    def on_done(self, index: int, result: tuple) -> None:
        """Request ``index`` finished: rank 0 sends its ``(ok, payload)`` to the engine."""
        if self.rank == 0:
            self.res_q.put(("done", result[0], (index, result[1])))


def _follow_commands(rank, runner, cmd_q, res_q, heartbeat_s, gather):
    """The command loop of every rank; returns ``None`` after ``shutdown``, or the
    ``(rank, error)`` that stopped the workers (a failed LoRA rollback)."""
    from sglang.multimodal_gen.distributed import broadcast_object
    from sglang.multimodal_gen.distributed.communication import broadcast_tensors_cpu

    held = None  # a command that arrived during a continuous loop (ContinuousLink.held)
    while True:
        cmd = None
        if rank == 0:
            if held is not None:
                cmd, held = held, None
            else:
                try:
                    cmd = cmd_q.get(timeout=heartbeat_s)
                except queue_mod.Empty:
                    cmd = ("noop", {})
            if cmd is not None and cmd[0] == "admitted":  # a late answer to a loop that ended
                if cmd[1]:
                    logger.warning("%d requests admitted after their loop ended", len(cmd[1]))
                continue
            if cmd is not None and cmd[0] not in ("noop", "shutdown"):
                try:  # set_lora: read the files once, here, and send their contents
                    cmd = (cmd[0], runner.prepare(*cmd))
                except BaseException as e:
                    res_q.put(("result", False, (0, pack_error(e))))
                    continue
        cmd = broadcast_object(cmd)
        if cmd is None or cmd[0] == "shutdown":
            return None
        op, kwargs = cmd
        link = None
        if kwargs.get("continuous"):
            device = runner.pipeline.device
            link = ContinuousLink(
                rank,
                runner,
                cmd_q,
                res_q,
                lambda o, d=device: broadcast_tensors_cpu(o, 0, d),
                answer_timeout_s=heartbeat_s,
            )
            kwargs = dict(kwargs, admit=link.admit, on_done=link.on_done)
            del kwargs["continuous"]
        decided: list = []

        def agree(exc, decided=decided):
            first = first_error(gather(None if exc is None else pack_error(exc)))
            decided.append(first)
            return first is None

        out, err = None, None
        try:
            out = runner.execute(op, kwargs, agree=agree)
        except BaseException as e:
            err = pack_error(e)
        errs = gather(err)
        # a LoRA change reports the error of the rank that failed, not a rollback notice
        failed = decided[0] if decided and decided[0] else first_error(errs)
        broken = [
            r
            for r, e in enumerate(errs)
            if e and e["type"] in ("LoRARollbackError", "LoRAStateError")
        ]
        if broken:
            failed = (
                broken[0],
                pack_error(
                    EngineDeadError(
                        f"{errs[broken[0]]['message']}; the TP workers stop (restart the engine)"
                    )
                ),
            )
        if link is not None:
            held = link.held
        if rank == 0 and op != "noop":
            res_q.put(("result", failed is None, failed if failed else out))
        if broken:
            return failed
