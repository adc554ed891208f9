"""What crosses the ring each step: a `SchedulerOutput` as a compact delta, and back.

Workers keep every live request's id and block table, so a step carries only what changed: each request's
id, prompt, sampling parameters and seed once (when new), then per scheduled sequence its request's small
index, inputs, start position, sample flag and only the block ids appended since that request was last
sent; finished requests free their index, preempted ones restart their table. Columns of int32 in native
byte order (both ends share one host), parameters pickled once per request. Plain Python, no torch.

    header   magic, counts: finished, preempted, new requests, seqs, input tokens, new blocks; new bytes; flags
             (bit 0: `propose_drafts`)
    int32    finished indices | preempted indices
    int32    per seq: index | start_pos | number of inputs | number of new blocks;  uint8 per seq: sample
             (bit 0), its drafts (`num_drafts`, speculative decoding: bits 1-6) and `chained` (bit 7)
    int32    every seq's inputs, concatenated (PLACEHOLDER is -1) | every seq's new block ids, concatenated
    bytes    per new request: index, prompt length, blob length (int32 x 3) | prompt | pickle((id, params, seed,
             lora_id, speculative))
    bytes    the step's copies to and from the KV tiers (`KVTransfers`), if any (a step without them ends with
             its new requests): counts of offloads, loads, restores, ahead and writes, and the wait flag (uint32
             x 6); then every entry's block or hash and slot as int64 (block hashes use all 64 bits), in that
             order; then the 16-byte digests of the loads, then of the writes

Between steps the ring also carries LoRA adapters added and removed (`encode_lora`: a magic of its own, then
the pickled command), in order with the steps: every rank loads an adapter before any step naming it.

A step's drafts are inputs like any other, so every rank verifies the same drafts in the same rows; the
step's `num_draft_tokens` is their sum, recomputed by the decoder.
"""

from __future__ import annotations

import pickle
import struct
from array import array
from dataclasses import dataclass

from asyncllm.step import KVTransfers, LoRAAdapter, NewRequestData, ScheduledSeq, SchedulerOutput

MAGIC = b"ATP2"
LORA_MAGIC = b"ALR1"
_HEADER = struct.Struct("<4s8I")
_NEW = struct.Struct("<3i")
_KV = struct.Struct("<6I")
_DIGEST = 16  # bytes of a block's prefix digest (`block_hash.extend_block_digests`)
_MAX_DRAFTS = 63  # a seq's drafts share its sample byte (config_speculative.MAX_SPECULATIVE_TOKENS is 16)
assert array("i").itemsize == 4 and array("B").itemsize == 1 and array("q").itemsize == 8


class StepCodecError(AssertionError):
    """An encoded step broke the codec's invariants (a bug, not bad input): the engine must stop."""


def _int32(values: list[int]) -> bytes:
    return array("i", values).tobytes()


@dataclass(frozen=True)
class AddLoRA:
    adapter: LoRAAdapter


@dataclass(frozen=True)
class RemoveLoRA:
    lora_id: int


def encode_lora(command: AddLoRA | RemoveLoRA) -> bytes:
    return LORA_MAGIC + pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)


class StepEncoder:
    """Rank 0's side: remembers what the workers already know and encodes each step as the difference."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}  # live request id -> its index in every worker's tables
        self._free: list[int] = []
        self._blocks_sent: list[int] = []  # by index: block ids the workers hold for that request
        self._last_block: list[int] = []  # by index: the last of them (a cheap check that tables only grow)

    @property
    def num_live(self) -> int:
        return len(self._index)

    def encode(self, out: SchedulerOutput) -> bytes:
        finished = [i for r in out.finished_request_ids if (i := self._index.pop(r, None)) is not None]
        self._free.extend(finished)
        news: list[bytes] = []
        for new in out.new_requests:
            i = self._assign(new.request_id)
            fields = (new.request_id, new.params, new.seed, new.lora_id, new.speculative)
            blob = pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL)
            prompt = _int32(new.prompt_token_ids)
            news += (_NEW.pack(i, len(new.prompt_token_ids), len(blob)), prompt, blob)
        preempted = [i for r in out.preempted_request_ids if (i := self._index.get(r)) is not None]
        sent, last = self._blocks_sent, self._last_block
        for i in preempted:
            sent[i] = 0  # its blocks were freed; it resumes with a table sent from scratch
        seqs = out.seqs
        index = [self._index[s.request_id] for s in seqs]
        num_tokens = [len(s.input_token_ids) for s in seqs]
        tokens: list[int] = []
        if sum(num_tokens) == len(seqs):  # decode-only: one input each
            tokens = [s.input_token_ids[0] for s in seqs]
        else:
            for s in seqs:
                tokens += s.input_token_ids
        new_blocks: list[int] = []
        num_new_blocks: list[int] = []
        for i, s in zip(index, seqs):
            blocks, known = s.block_ids, sent[i]
            n = len(blocks)
            if known and (n < known or blocks[known - 1] != last[i]):
                raise StepCodecError(f"block table of {s.request_id!r} changed other than by appending")
            num_new_blocks.append(n - known)
            if n != known:
                new_blocks += blocks[known:]
                sent[i] = n
                last[i] = blocks[-1]
        new_bytes = b"".join(news)
        kv = encode_kv(out.kv) if out.kv is not None else b""
        header = _HEADER.pack(
            MAGIC, len(finished), len(preempted), len(out.new_requests), len(seqs), len(tokens), len(new_blocks),
            len(new_bytes), int(out.propose_drafts),
        )  # fmt: skip
        columns = finished + preempted + index + [s.start_pos for s in seqs] + num_tokens + num_new_blocks
        if out.num_draft_tokens and max(s.num_drafts for s in seqs) > _MAX_DRAFTS:
            raise StepCodecError(f"a sequence carries more than {_MAX_DRAFTS} drafts")
        sample = bytes([s.sample | s.num_drafts << 1 | s.chained << 7 for s in seqs])
        return b"".join((header, _int32(columns), sample, _int32(tokens + new_blocks), new_bytes, kv))

    def _assign(self, request_id: str) -> int:
        if request_id in self._index:
            raise StepCodecError(f"request {request_id!r} was sent as new twice")
        if self._free:
            i = self._free.pop()
        else:
            i = len(self._blocks_sent)
            self._blocks_sent.append(0)
            self._last_block.append(0)
        self._index[request_id] = i
        self._blocks_sent[i] = 0
        return i


class StepDecoder:
    """A worker's side: keeps each live request's id and block table, and rebuilds whole steps."""

    def __init__(self) -> None:
        self._ids: list[str] = []  # by index
        self._tables: list[list[int]] = []  # by index: the request's whole block table

    def decode_message(self, data: bytes) -> SchedulerOutput | AddLoRA | RemoveLoRA:
        """What one ring message carries: a step, or a LoRA adapter added or removed between steps."""
        if data[:4] == LORA_MAGIC:
            command = pickle.loads(data[4:])
            if not isinstance(command, (AddLoRA, RemoveLoRA)):
                raise StepCodecError(f"a LoRA message holds {type(command).__name__}")
            return command
        return self.decode(data)

    def decode(self, data: bytes) -> SchedulerOutput:
        """The step `data` encodes. Its `ScheduledSeq.block_ids` are this decoder's own tables: valid until
        the next `decode` (the runner reads them within the step)."""
        magic, n_fin, n_pre, n_new, n_seqs, n_tok, n_blk, new_bytes, flags = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise StepCodecError(f"not an encoded step (magic {magic!r})")
        at = _HEADER.size
        columns = array("i")
        columns.frombytes(data[at : at + 4 * (n_fin + n_pre + 4 * n_seqs)])
        cols = columns.tolist()
        at += 4 * len(cols)
        sample = data[at : at + n_seqs]
        at += n_seqs
        flat = array("i")
        flat.frombytes(data[at : at + 4 * (n_tok + n_blk)])
        at += 4 * (n_tok + n_blk)
        ids, tables = self._ids, self._tables
        finished = [ids[i] for i in cols[:n_fin]]
        new_requests = self._add_new(data, at, n_new)
        end = at + new_bytes
        kv = decode_kv(data[end:]) if end < len(data) else None
        preempted = [ids[i] for i in cols[n_fin : n_fin + n_pre]]
        for i in cols[n_fin : n_fin + n_pre]:
            tables[i] = []
        c = n_fin + n_pre
        index, starts = cols[c : c + n_seqs], cols[c + n_seqs : c + 2 * n_seqs]
        num_tokens, num_new_blocks = cols[c + 2 * n_seqs : c + 3 * n_seqs], cols[c + 3 * n_seqs : c + 4 * n_seqs]
        values = flat.tolist()
        if n_tok == n_seqs:
            inputs = [[t] for t in values[:n_tok]]
        else:
            inputs, t = [], 0
            for n in num_tokens:
                inputs.append(values[t : t + n])
                t += n
        b = n_tok
        seqs = []
        num_draft_tokens = 0
        for i, start, toks, n, s in zip(index, starts, inputs, num_new_blocks, sample):
            table = tables[i]
            if n:
                table += values[b : b + n]
                b += n
            seqs.append(ScheduledSeq(ids[i], toks, start, table, bool(s & 1), (s >> 1) & 63, bool(s >> 7)))
            num_draft_tokens += (s >> 1) & 63
        return SchedulerOutput(seqs, new_requests, finished, preempted, num_draft_tokens, kv, bool(flags & 1))

    def _add_new(self, data: bytes, at: int, count: int) -> list[NewRequestData]:
        out = []
        for _ in range(count):
            i, prompt_len, blob_len = _NEW.unpack_from(data, at)
            at += _NEW.size
            prompt = array("i")
            prompt.frombytes(data[at : at + 4 * prompt_len])
            at += 4 * prompt_len
            request_id, params, seed, lora_id, speculative = pickle.loads(data[at : at + blob_len])
            at += blob_len
            while len(self._ids) <= i:
                self._ids.append("")
                self._tables.append([])
            self._ids[i] = request_id
            self._tables[i] = []
            out.append(NewRequestData(request_id, prompt.tolist(), params, seed, lora_id, speculative=speculative))
        return out


def encode_kv(kv: KVTransfers) -> bytes:
    # Hashes (the first of each entry in loads and writes) use all 64 bits: they travel as int64, two's complement.
    signed = [[(h - 2**64 if h >= 2**63 else h, slot) for h, slot, _ in entries] for entries in (kv.loads, kv.writes)]
    lists = (kv.offloads, signed[0], kv.restores, kv.ahead, signed[1])
    values = array("q", [v for pairs in lists for pair in pairs for v in pair])
    digests = b"".join(digest for _, _, digest in (*kv.loads, *kv.writes))
    assert len(digests) == _DIGEST * (len(kv.loads) + len(kv.writes)), "a block digest is 16 bytes"
    return _KV.pack(*map(len, lists), kv.wait) + values.tobytes() + digests


def decode_kv(data: bytes) -> KVTransfers:
    *counts, wait = _KV.unpack_from(data)
    size = _KV.size + 16 * sum(counts) + _DIGEST * (counts[1] + counts[4])
    if len(data) != size:  # a step's last section: a stray byte would land here
        raise StepCodecError(f"an encoded step's KV copies take {len(data)} bytes, not {size}")
    flat = array("q")
    at = _KV.size + 16 * sum(counts)
    flat.frombytes(data[_KV.size : at])
    values = flat.tolist()
    lists: list[list[tuple[int, int]]] = []
    i = 0
    for count in counts:
        lists.append([(values[i + 2 * j], values[i + 2 * j + 1]) for j in range(count)])
        i += 2 * count
    offloads, loads, restores, ahead, writes = lists
    with_digests: list[list[tuple[int, int, bytes]]] = []
    for pairs in (loads, writes):
        with_digests.append(
            [(h % 2**64, slot, data[at + _DIGEST * j : at + _DIGEST * (j + 1)]) for j, (h, slot) in enumerate(pairs)]
        )
        at += _DIGEST * len(pairs)
    return KVTransfers(offloads, with_digests[0], restores, ahead, with_digests[1], bool(wait))
