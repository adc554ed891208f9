"""`VerifyReads`: a tensor-parallel worker's reads of the steps that verify drafts (speculative decoding).

Reading a verifying step settles its requests' sampling state (`worker/spec_verify.py`: the draws past each
accepted run are given back, the penalty counts of tokens never output taken back), as the core's read does
on rank 0; a worker, whose outputs nobody reads, reads them here so that its state stays rank 0's. A read
waits for the step, so it is put off until the next step is submitted (the device stays busy), unless that
step names one of the read step's drafted requests: then it comes first, as rank 0's core reads a
speculative request's step before planning the request again; except where the next step is chained on it
(`ScheduledSeq.chained`, core/spec/chain.py), which rank 0 launches before that read too. Plain Python: it
drives the worker's `StepResult`s.
"""

from __future__ import annotations

from asyncllm.step import SchedulerOutput, StepResult


class VerifyReads:
    def __init__(self) -> None:
        self._unread: StepResult | None = None  # the last step submitted, if it verifies drafts
        self._requests: frozenset[str] = frozenset()  # that step's drafted requests

    def before_submit(self, step: SchedulerOutput) -> None:
        """Read the unread step now if `step` names one of its drafted requests (samples, finishes or preempts
        it): their state must be settled first."""
        if self._unread is None:
            return
        named = {seq.request_id for seq in step.seqs if not seq.chained}  # a chained one is staged first on rank 0
        named.update(step.finished_request_ids, step.preempted_request_ids)
        if not self._requests.isdisjoint(named):
            self._read()

    def after_submit(self, step: SchedulerOutput, result: StepResult) -> None:
        """Read the step before `step` if still unread; keep `result` to read later if `step` verifies drafts."""
        if self._unread is not None:
            self._read()
        if step.num_draft_tokens:
            self._unread = result
            self._requests = frozenset(seq.request_id for seq in step.seqs if seq.num_drafts)

    def _read(self) -> None:
        unread, self._unread = self._unread, None
        assert unread is not None
        unread.result()
