"""`GrammarBackend`: output constraints (`StructuredOutput`) compiled by xgrammar over one model's vocabulary.

One per process, made by the worker (it knows the tokenizer, the embedding rows and the EOS ids) and shared:
the in-process executor hands its backend to the front (`build.py`), which compiles each constraint when the
request is made, so a bad one raises `InvalidRequestError` naming its field before it reaches the core, and
the runner's later compile is a cache hit. The vocabulary's `TokenizerInfo` is built at the first compile
(it reads every token: most of a second for a large vocabulary), or ahead of it by `prepare_async` (the
worker calls it at start-up on CUDA). The grammar process (`grammar_process.py`) compiles with its own,
made `from_tables` of the worker's. Knows nothing of requests, steps or devices.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncllm.errors import InvalidRequestError
from asyncllm.structured import StructuredKind, StructuredOutput
from asyncllm.structured_output.utf8 import Utf8Table

if TYPE_CHECKING:
    import xgrammar as xgr  # imported at the first compile: engines without constraints never load it

# Constraints a watcher added later is told of at once (`watch`): those of the requests likely still live.
RECENT_SPECS = 64

# Compiled grammars kept by the compiler (keyed by the constraint's text and options), least recently used
# out first: a small schema over a large vocabulary takes a few MiB.
CACHE_LIMIT_BYTES = 512 * 2**20

_WHAT = {
    StructuredKind.JSON_SCHEMA: "a JSON schema xgrammar supports",
    StructuredKind.JSON_OBJECT: "a JSON object grammar",
    StructuredKind.REGEX: "a regular expression xgrammar supports",
    StructuredKind.CHOICE: "a list of choices",
    StructuredKind.GRAMMAR: "an EBNF grammar with a root rule",
}
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[12:00:00] /path/file.cc:123: " before its message


@dataclass(frozen=True)
class VocabularyTables:
    """A vocabulary's tables as plain data, for a process without the tokenizer (the grammar process):
    xgrammar's tokenizer info, serialized, and the UTF-8 table."""

    tokenizer_info: str  # xgrammar's TokenizerInfo.serialize_json()
    utf8_next: np.ndarray  # Utf8Table.next
    utf8_allowed: np.ndarray  # Utf8Table.allowed
    vocab_size: int
    stop_token_ids: list[int]


class GrammarBackend:
    """`compile(spec)` a constraint (cached), `check(spec)` it for the front, `compile_async(spec)` off the
    calling thread; all three raise (or resolve to) `InvalidRequestError` naming the constraint's field.
    `prepare_async()` builds the vocabulary's tables ahead of the first compile; `tables()` exports them,
    and `from_tables` makes a backend of them in another process. A `deferred` backend loads its tokenizer
    when first read."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int]) -> None:
        if not stop_token_ids:
            raise ValueError("GrammarBackend: a complete constraint ends with a stop token; give the EOS ids")
        self._tokenizer = tokenizer
        self._load_tokenizer: Callable[[], Any] | None = None  # set by `deferred`: loads `tokenizer` at first read
        self._tokenizer_lock = threading.Lock()
        self.vocab_size = vocab_size  # the model's embedding rows (the tokenizer may have fewer tokens)
        self.stop_token_ids = sorted(stop_token_ids)
        self._lock = threading.Lock()  # held while the vocabulary's tables are built
        self._pool_lock = threading.Lock()  # never held long: compile_async must not wait for those tables
        self._compiler: xgr.GrammarCompiler | None = None
        self._info: xgr.TokenizerInfo | None = None
        self._utf8: Utf8Table | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._watch_lock = threading.Lock()
        self._watchers: list[Callable[[StructuredOutput], None]] = []
        self._recent: OrderedDict[StructuredOutput, None] = OrderedDict()  # the last constraints compiled

    @classmethod
    def deferred(
        cls, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: Collection[int]
    ) -> GrammarBackend:
        """A backend whose tokenizer is loaded at its first read (a tensor-parallel worker's: only a constraint
        needs it, and most engines never see one)."""
        backend = cls(None, vocab_size, stop_token_ids)
        backend._load_tokenizer = load_tokenizer
        return backend

    @property
    def tokenizer(self) -> Any:
        """The vocabulary's tokenizer (loaded now if it was `deferred`); None for a backend `from_tables`."""
        with self._tokenizer_lock:  # its own lock: `_vocabulary` reads it holding `_lock`
            if self._load_tokenizer is not None:
                self._tokenizer, self._load_tokenizer = self._load_tokenizer(), None
            return self._tokenizer

    @classmethod
    def from_tables(cls, tables: VocabularyTables) -> GrammarBackend:
        """A backend over another's vocabulary (`tables()`): compiles exactly as that one does."""
        import xgrammar as xgr

        backend = cls(None, tables.vocab_size, tables.stop_token_ids)
        backend._info = xgr.TokenizerInfo.deserialize_json(tables.tokenizer_info)
        backend._utf8 = Utf8Table.from_arrays(tables.utf8_next, tables.utf8_allowed)
        backend._compiler = xgr.GrammarCompiler(backend._info, cache_limit_bytes=CACHE_LIMIT_BYTES)
        return backend

    def tables(self) -> VocabularyTables:
        """The vocabulary's tables as plain data (built first if need be; xgrammar serializes without the GIL)."""
        utf8 = self.utf8
        assert self._info is not None
        return VocabularyTables(
            self._info.serialize_json(), utf8.next, utf8.allowed, self.vocab_size, list(self.stop_token_ids)
        )

    @property
    def bitmask_words(self) -> int:
        """int32 words of one bitmask row: 32 tokens a word."""
        return -(-self.vocab_size // 32)

    @property
    def utf8(self) -> Utf8Table:
        """The vocabulary's UTF-8 table (built with the compiler, at the first compile)."""
        self._vocabulary()
        assert self._utf8 is not None
        return self._utf8

    def check(self, spec: StructuredOutput) -> None:
        """Raise `InvalidRequestError` unless `spec` compiles (it stays cached for the runner)."""
        self.compile(spec)

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        with self._watch_lock:  # who else compiles over this vocabulary (the grammar process) starts now too
            self._recent[spec] = None
            self._recent.move_to_end(spec)
            if len(self._recent) > RECENT_SPECS:
                self._recent.popitem(last=False)
            watchers = list(self._watchers)
        for watcher in watchers:
            watcher(spec)
        compiler = self._vocabulary()
        try:
            return _compile(compiler, spec)
        except (RuntimeError, ValueError) as exc:  # xgrammar's errors name what it could not read
            message = _LOG_PREFIX.sub("", str(exc)).strip()
            raise InvalidRequestError(f"SamplingParams.{spec.field} is not {_WHAT[spec.kind]}: {message}") from None

    def watch(self, watcher: Callable[[StructuredOutput], None]) -> None:
        """Have `watcher(spec)` called as each constraint's compile starts (from the compiling thread, every
        time: it must be quick), and at once for the last few compiled before."""
        with self._watch_lock:
            self._watchers.append(watcher)
            recent = list(self._recent)
        for spec in recent:
            watcher(spec)

    def unwatch(self, watcher: Callable[[StructuredOutput], None]) -> None:
        with self._watch_lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def compile_async(self, spec: StructuredOutput) -> Future[xgr.CompiledGrammar]:
        """`compile(spec)` on the backend's thread (xgrammar releases the GIL while it compiles)."""
        return self._thread().submit(self.compile, spec)

    def prepare_async(self) -> Future[object]:
        """Build the vocabulary's tables (the compiler's and the UTF-8 table) on the backend's thread now, so
        the first constraint does not wait for them; a compile queued meanwhile runs after. A failure here
        is left for that compile to raise as well."""
        return self._thread().submit(self._vocabulary)

    def _thread(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncllm-grammar")
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _vocabulary(self) -> xgr.GrammarCompiler:
        """The compiler (and the UTF-8 table) over the vocabulary, made at the first call."""
        with self._lock:  # the front's thread and the step thread may both come first
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                pieces = list(info.decoded_vocab)  # the bytes each token spells, as xgrammar reads them
                # The output text skips the tokenizer's special added tokens (<|im_start|>...), which xgrammar
                # may take for text: to the grammar they must spell nothing too (a byte-level vocabulary's
                # pieces are exact bytes, so the raw form of the same pieces is the same vocabulary).
                skipped = [t for t in _skipped_special_ids(self.tokenizer, len(pieces)) if pieces[t]]
                skipped = [t for t in skipped if t not in self.stop_token_ids]
                if skipped and info.vocab_type == xgr.VocabType.BYTE_LEVEL:
                    for token in skipped:
                        pieces[token] = b""
                    info = xgr.TokenizerInfo(
                        pieces, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                    )
                self._utf8 = Utf8Table(pieces, self.stop_token_ids, self.bitmask_words)
                self._info = info
                self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler


def _skipped_special_ids(tokenizer: Any, vocab: int) -> list[int]:
    """Ids of the added tokens a decode skips (flagged special)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return [token for token, added_token in added.items() if getattr(added_token, "special", False) and token < vocab]


def _compile(compiler: xgr.GrammarCompiler, spec: StructuredOutput) -> xgr.CompiledGrammar:
    kind = spec.kind
    if kind is StructuredKind.JSON_SCHEMA:
        # No free whitespace: a model that likes spaces (a random one always does) could otherwise pad an
        # output forever. Strict: properties and items the schema does not name are not generated.
        schema = bounded_strings_as_patterns(spec.text)
        return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
    if kind is StructuredKind.JSON_OBJECT:
        # Any object (not xgrammar's builtin JSON grammar, which also takes a top-level array and any
        # whitespace): the schema {"type": "object"}, its members left free.
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind is StructuredKind.REGEX:
        return compiler.compile_regex(spec.text)
    if kind is StructuredKind.CHOICE:
        return compiler.compile_grammar(choice_grammar(spec.choices))
    return compiler.compile_grammar(spec.text)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose root is exactly one of `choices` (JSON string literals are EBNF string literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@functools.lru_cache(maxsize=256)
def bounded_strings_as_patterns(schema_text: str) -> str:
    """The schema with each string's minLength/maxLength (when it has no pattern or format of its own) given
    as the equivalent pattern over characters a JSON string holds unescaped.

    xgrammar 0.2.9 compiles a length-bounded string to a class that admits raw control characters, which
    JSON forbids (mlc-ai/xgrammar#800): the outputs would not parse. Its pattern path reads JSON strings
    right. The bounded string then holds no escapes (neither did xgrammar's own form). Drop this once fixed.
    """
    schema = json.loads(schema_text)
    rewritten = _rewrite(schema)
    return schema_text if rewritten is schema else json.dumps(rewritten)


def _rewrite(node: Any) -> Any:
    """`node` with its bounded strings rewritten, or `node` itself when nothing in it changed."""
    if isinstance(node, list):
        items = [_rewrite(item) for item in node]
        return node if all(a is b for a, b in zip(items, node)) else items
    if not isinstance(node, dict):
        return node
    out = {key: _rewrite(value) for key, value in node.items()}
    low, high = out.get("minLength"), out.get("maxLength")
    lengths = [v for v in (low, high) if v is not None]
    kind = out.get("type")
    if (
        (kind == "string" or (isinstance(kind, list) and "string" in kind))  # lengths bind strings alone
        and lengths
        and all(type(v) is int and v >= 0 for v in lengths)
        and not {"pattern", "format", "enum", "const"} & out.keys()
    ):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        bounds = f"{low or 0},{'' if high is None else high}"
        out["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{bounds}}}$'
    return node if all(out[k] is node.get(k) for k in out) and out.keys() == node.keys() else out
