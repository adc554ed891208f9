"""`SampledTokens`: the scheduler's side of a step's output, each sampled token appended to its request (a part
of `Scheduler`, kept apart from the planning). Plain Python."""

from __future__ import annotations

from asyncllm.core.request import Request, RequestStatus
from asyncllm.step import SchedulerOutput


class SampledTokens:
    requests: dict[str, Request]  # the scheduler's live requests

    def update_from_output(self, out: SchedulerOutput, sampled: list[int]) -> list[tuple[Request, int, int]]:
        """Append each sampled token to its request; returns (request, token, sample index) for live ones.

        Requests finished (aborted, or stopped by the previous step's output) since `out` was planned are
        skipped: their token is dropped, as is a token appended ahead of its draw (`start_forced_run`). A
        request preempted meanwhile keeps its token, which was computed from valid KV: it is streamed like any
        other and recomputed with the rest when the request resumes.
        """
        results: list[tuple[Request, int, int]] = []
        sampling = [s for s in out.seqs if s.sample]
        assert len(sampling) == len(sampled), "one sampled token per sampling sequence"
        for index, (seq, token_id) in enumerate(zip(sampling, sampled)):
            request = self.requests.get(seq.request_id)
            if request is None or request.status is RequestStatus.FINISHED:
                continue
            if seq.num_drafts:
                request.num_verifying -= 1
            if request.num_drawn_ahead:  # the first token of a forced run, appended when the run was known
                request.num_drawn_ahead -= 1
                continue
            request.num_pending_tokens -= 1
            request.append_token(token_id)
            results.append((request, token_id, index))
        return results

    @staticmethod
    def start_forced_run(request: Request) -> None:
        """A forced run (jump-forward) is about to be appended after the request's last known token. A draw
        of the request already submitted (overlapped scheduling) is the run's first token: no longer pending,
        and its output dropped when it comes. The rest are computed by its next step, like a prompt chunk."""
        if request.num_pending_tokens:
            request.num_pending_tokens -= 1
            request.num_drawn_ahead += 1
