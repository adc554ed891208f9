"""`EngineStats`: the engine core's counters as `stats()` reports them (`engine.stats()`, `/metrics`). Plain data;
the running totals are never reset, so engines' figures can be summed and their rates pooled."""

from __future__ import annotations

from dataclasses import dataclass

SPEC_POSITION_KEY = "spec_accepted_tokens_pos_"  # + the position: `as_dict`'s keys for accepted drafts


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_steps: int  # steps that ran the model
    # The hit rate's terms (prompt tokens looked up, and found cached), so engines' rates can be pooled.
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    spec_draft_tokens: int = 0  # speculative decoding: drafts verified, and of those accepted (running totals)
    spec_accepted_tokens: int = 0
    spec_num_drafts: int = 0  # verified proposals (a request's drafts in one step: vLLM's num_drafts)
    # Of the drafts verified, those of steps planned while the request's previous step was in flight, chained on
    # it (core/spec/chain.py); and the drafts of chained steps found void (never verified, not counted above).
    spec_chained_drafts: int = 0
    spec_void_drafts: int = 0
    # Of the hit tokens, those restored from the KV tiers below the device (`kv_offloading_size`, `kv_cache_dir`).
    prefix_cache_host_hit_tokens: int = 0
    prefix_cache_disk_hit_tokens: int = 0
    cuda_graphs_pending: int = 0  # lazy capture: graphs not captured yet (by an idle engine, or a step needing one)
    # Accepted drafts by position in their proposal (0: the first draft), one per num_speculative_tokens; in
    # `as_dict` each is a key of its own, `spec_accepted_tokens_pos_<i>` (a flat dict sums across replicas).
    spec_accepted_per_position: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, float | int]:
        flat: dict[str, float | int] = {k: v for k, v in self.__dict__.items() if k != "spec_accepted_per_position"}
        for position, count in enumerate(self.spec_accepted_per_position):
            flat[f"{SPEC_POSITION_KEY}{position}"] = count
        return flat
