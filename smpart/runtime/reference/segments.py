"""Backward segments (`BackwardSegments`, part of `StageServer`): one job per micro-batch's gradients.

Gradient messages join their micro-batch's backlog; one segment, holding the stage's turn, takes
everything queued by then, runs one stage-local backward (`gradients.backpropagate`, holding back
what more messages will reach), and sends the gradients it posted, with their share of credit,
before it gives the turn back.
"""

from __future__ import annotations

import time
from fractions import Fraction

from smpart.errors import PipelineError, SmpartError
from smpart.runtime.reference.calls import Frame, as_pipeline_error, running
from smpart.runtime.reference.gradients import Holding, backpropagate, dispatch, module_of
from smpart.runtime.reference.scheduler import SEGMENT, Cancelled, Claim, TimedOut
from smpart.runtime.reference.stage_step import StageStep
from smpart.runtime.reference.workers import POLL_S, debug
from smpart.runtime.schedule import BACKWARD, Action
from smpart.runtime.wire.messages import Credit, Failed, Gradients


class BackwardSegments:
    """The backward half of `StageServer` (see the module docstring)."""

    # ================================================================ backward segments
    def _run_segment(self, run: StageStep, mb: int) -> None:
        """One backward segment for every gradient message of ``mb`` queued by the time it runs.
        Returns the job its gradients started on a stage of this process, to run next on this
        thread (`run_job`): the thread was done, and another would have to wake up for it."""
        claim = Claim(Action(BACKWARD, mb), SEGMENT)
        try:
            run.scheduler.acquire(claim, run.timeout_s, lambda: self._describe_wait(run, None, mb),
                                  self.transport.check)
        except Cancelled:
            return
        except (TimedOut, SmpartError) as err:
            failure = PipelineError(str(err), stage=self.stage, microbatch=mb, rank=self.rank)
            self.send(run.coordinator, Failed(run.step, failure))
            return
        start = time.time()
        try:
            messages = self._take_backlog(run, mb, claim)
        except (Cancelled, TimedOut, SmpartError) as err:
            run.scheduler.release(claim)
            if not isinstance(err, Cancelled):
                failure = PipelineError(str(err), stage=self.stage, microbatch=mb, rank=self.rank)
                self.send(run.coordinator, Failed(run.step, failure))
            return
        self._announce(run, claim, tuple(m.origin for m in messages))
        if self.debug:
            flush = " (flush)" if any(m.flush for m in messages) else ""
            debug("stage %d runs %s: a backward segment for %d gradient message(s)%s", self.stage,
                  claim.action, len(messages), flush)
        credit = sum((m.credit for m in messages), Fraction(0))
        served, sent = run.served.get(mb, {}), run.sent.get(mb, {})
        holding = self._holding(run, mb)
        failed = False
        try:
            if mb not in run.released:
                with running(Frame(self, run.step, mb, run=run, claim=claim)):
                    call_by_call = self.tp_follower or bool(self.tp_followers)
                    backpropagate(served, sent, messages, call_by_call, holding)
        except Exception as err:
            failed = True
            failure = as_pipeline_error(err, self.stage, module_of(served, sent, messages), mb, "backward",
                                        rank=self.rank)
            self.send(run.coordinator, Failed(run.step, failure))
        finally:
            posts = run.outbox.take()
            run.spans.append((mb, "backward", start, time.time()))
        try:  # the gradients go before the turn does (see `_run_call`)
            if not failed and not run.aborted:
                if bool(holding.pending) != holding.reported:  # tell the driver, with credit
                    holding.reported = not holding.reported
                    news, credit = credit / 2, credit - credit / 2
                    self.send(run.home(mb), Credit(run.step, mb, news, (self.address, holding.reported)))
                home, sent = run.home(mb), run.gradients_sent[mb]
                dispatch(self.send, posts, credit, run.step, mb, home, self.stage, sent)
        finally:
            run.scheduler.release(claim)

    def _holding(self, run: StageStep, mb: int) -> Holding:
        holding = run.holdings.get(mb)
        if holding is None:
            names = run.record_names
            expected = self.messages_per_record if run.holding else {}  # off: nothing is held back
            holding = run.holdings[mb] = Holding(lambda call_id, to_outputs: expected.get(
                names.get((call_id, to_outputs)), 0))
        return holding

    def _take_backlog(self, run: StageStep, mb: int, claim: Claim) -> list[Gradients]:
        """The gradient messages this segment consumes, in the order of their origins (so that
        every tensor-parallel rank back-propagates the same tensors in the same order): all that
        are queued, or on a follower those its leader's segment consumed (waiting for them)."""
        if not self.tp_follower:
            with run.lock:
                messages = run.backlog.pop(mb, [])
                run.segment_queued.discard(mb)
            return sorted(messages, key=lambda m: m.origin)
        wanted = set(claim.payload)
        deadline = time.monotonic() + run.timeout_s
        with run.gradients_came:  # woken by each message; every POLL_S it checks for lost peers
            while not wanted <= {m.origin for m in run.backlog.get(mb, [])}:
                self._check(run)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimedOut(self._describe_wait(run, None, mb))
                run.gradients_came.wait(min(POLL_S, left))
            queued = run.backlog[mb]
            taken = [m for m in queued if m.origin in wanted]
            rest = [m for m in queued if m.origin not in wanted]
            run.backlog[mb] = rest
            if not rest:
                run.segment_queued.discard(mb)
        if rest:  # gradients that a later segment of the leader consumed
            self.workers.submit(lambda: self._run_segment(run, mb))
        return sorted(taken, key=lambda m: m.origin)
