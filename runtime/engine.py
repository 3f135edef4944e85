"""Run one step of a CPU engine: a packed batch of prefill chunks and decode tokens -> logits + KV written."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from trtbuild.builder.engine_dir import EngineInfo, cpu_rank_files, read_engine_config
from trtbuild.configs import LORA_IDS_INPUT, BuildConfig, group_input, num_cache_layers
from trtbuild.cpu_ops import library_for_engine
from trtbuild.errors import EngineCompatibilityError
from trtbuild.plugins.gated_delta import CHECKPOINTS_INPUT
from trtbuild.quantization import kv_pool_dtype
from trtbuild.runtime.kv_cache import KVCacheStorage
from trtbuild.runtime.lora_slots import LoraSlotArrays
from trtbuild.runtime.memory import require_memory
from trtbuild.runtime.recurrent_state import RecurrentStateStorage, StateCopy

LOAD_OVERHEAD_BYTES = 256 << 20  # ONNX Runtime's session, arenas and this process, beside the weights


@dataclass(frozen=True)
class DraftAccept:
    """Verify a chunk's drafts inside the engine (SpeculativeAccept, engines built with draft-tokens mode): the
    chunk ends with `draft_tokens` and asks one logits row per draft plus one, which stay in the engine.
    `uniforms`: the request's next random numbers, at most one per row (greedy: none needed; missing ones are 0)."""

    draft_tokens: tuple[int, ...]
    temperature: float  # 0: greedy
    uniforms: tuple[float, ...] = ()


@dataclass(frozen=True)
class StepOutput:
    logits: np.ndarray  # [rows, vocab]: the logits rows of the chunks without `accept`, chunk by chunk in order
    accepted: dict[int, tuple[int, int]]  # chunk index -> (drafts accepted, next token), for chunks with `accept`


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's share of a step: compute tokens [start, start + len(token_ids)) of sequence `seq_id`.

    Logits come back for the chunk's last `num_logits` tokens: 1 when the chunk ends at the sequence's newest token,
    0 for a prefill chunk that does not, more to verify draft tokens or to score a prompt.
    """

    seq_id: int | str
    token_ids: list[int]
    start: int  # tokens already in the KV cache (the past length)
    num_logits: int
    block_ids: tuple[int, ...] | list[int]  # the sequence's block table, covering at least start + len(token_ids)
    accept: DraftAccept | None = None  # its drafts verified by the engine, its logits rows kept there
    # the tables of the engine's other KV cache groups (configs/kv_groups.py), each as long as block_ids: one per
    # group after the first; empty for an engine of one group
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    lora_id: int = 0  # the LoRA adapter its tokens run under: 0 none, i the engine's i-th (BuildConfig.lora_names)
    # its state slot (runtime/recurrent_state.py), for an engine with recurrent layers; -1: none
    state_slot: int = -1
    # keep its recurrent state after this many of its tokens in the slot's draft checkpoint (a chunk ending in drafts:
    # its known tokens); 0: not kept
    state_checkpoint: int = 0

    def tables(self) -> tuple[Sequence[int], ...]:
        """The block table of every KV cache group, the first group's first."""
        return (self.block_ids, *self.group_block_ids)


def in_every_group(chunks: list[SequenceChunk], num_groups: int, stride: int) -> list[SequenceChunk]:
    """Chunks laid out by a caller that owns the pool (verify, autotune, perplexity, tests), given their first
    group's block tables, with one table per other KV cache group (configs/kv_groups.py): group g's blocks are the
    first group's plus g * stride, so that a pool of num_groups * stride blocks holds the groups apart. A chunk
    without a recurrent state slot gets its sequence's id as one where that is a number, else its index here."""
    return [replace(c, group_block_ids=tuple(tuple(b + g * stride for b in c.block_ids) for g in range(1, num_groups)),
                    state_slot=c.state_slot if c.state_slot >= 0 else c.seq_id if isinstance(c.seq_id, int) else i)
            for i, c in enumerate(chunks)]


# NOTE: the CPU attention lowering pads every sequence's queries to the step's longest chunk. Beside a long prefill
# chunk, each short chunk (a decode token) then costs as many query rows as that chunk: one 128-token chunk among
# 15 decodes made a 397-token step take 0.46 s instead of ~0.15 s. Past this many padded query x key pairs per head,
# the short chunks run as a second engine call, whose extra pass over the weights costs less (2-core CPU, SmolLM2).
PADDING_SPLIT_PAIRS = 1 << 16


def attention_groups(chunks: list[SequenceChunk]) -> list[list[int]]:
    """Indices of `chunks` per engine call: all of them, or the long chunks and the short ones (at most a quarter of
    the longest) apart when padding the short ones to the longest would waste more than PADDING_SPLIT_PAIRS."""
    longest = max(len(c.token_ids) for c in chunks)
    short = [i for i, c in enumerate(chunks) if 4 * len(c.token_ids) <= longest]
    keys = longest + max(c.start for c in chunks)
    if not short or len(short) == len(chunks) or len(short) * longest * keys < PADDING_SPLIT_PAIRS:
        return [list(range(len(chunks)))]
    return [[i for i, c in enumerate(chunks) if 4 * len(c.token_ids) > longest], short]


def check_chunks(b: BuildConfig, chunks: list[SequenceChunk], max_draft_len: int, num_groups: int = 1,
                 num_state_slots: int = 0) -> None:
    """Refuse a step the engine's build limits do not cover, before anything writes the pool (every engine of
    `num_groups` KV cache groups; `num_state_slots`: its recurrent state slots, 0 for a model without)."""
    if not chunks:
        raise ValueError("a step needs at least one sequence chunk")
    if num_state_slots:
        slots = [c.state_slot for c in chunks]
        if not all(0 <= s < num_state_slots for s in slots) or len(set(slots)) != len(slots):
            raise ValueError(f"state slots {slots}: each sequence of an engine with recurrent layers needs its own "
                             f"state slot, one of 0..{num_state_slots - 1}")
        if any(not 0 <= c.state_checkpoint <= len(c.token_ids) for c in chunks):
            raise ValueError("a chunk's state checkpoint must come after some of its own tokens")
    if len(chunks) > b.max_batch_size:
        raise ValueError(f"{len(chunks)} sequences exceed the engine's max_batch_size {b.max_batch_size}")
    num_tokens = sum(len(c.token_ids) for c in chunks)
    if num_tokens > b.max_num_tokens:
        raise ValueError(f"{num_tokens} tokens exceed the engine's max_num_tokens {b.max_num_tokens}")
    for c in chunks:  # all checked before any call writes the pool
        end = c.start + len(c.token_ids)
        if not 0 <= c.num_logits <= len(c.token_ids):
            raise ValueError(f"num_logits {c.num_logits} is outside 0..{len(c.token_ids)} for sequence {c.seq_id}")
        if end > b.max_seq_len:
            raise ValueError(f"sequence {c.seq_id} reaches {end} tokens, beyond max_seq_len {b.max_seq_len}")
        if not 0 <= c.lora_id <= b.num_lora_ids:
            raise ValueError(f"sequence {c.seq_id}: LoRA adapter {c.lora_id} of an engine built with "
                             f"{b.num_lora_ids} (0 is none)")
        if len(c.group_block_ids) != num_groups - 1:
            raise ValueError(f"sequence {c.seq_id} has {1 + len(c.group_block_ids)} block tables; this engine's KV "
                             f"cache has {num_groups} groups, one table each")
        for table in c.tables():
            if len(table) * b.tokens_per_block < end:
                raise ValueError(f"sequence {c.seq_id} has {len(table)} blocks, too few for {end} tokens")
            if len(table) > b.max_blocks_per_seq:
                raise ValueError(f"sequence {c.seq_id} has {len(table)} blocks; the engine's block tables hold "
                                 f"{b.max_blocks_per_seq} (max_seq_len {b.max_seq_len})")
        if c.accept is not None:
            _check_accept(c, max_draft_len)


def _check_accept(c: SequenceChunk, max_draft_len: int) -> None:
    drafts = c.accept.draft_tokens
    if not max_draft_len:
        raise ValueError(f"sequence {c.seq_id}: this engine does not verify drafts (built without "
                         "--speculative-decoding-mode draft-tokens)")
    if len(drafts) > max_draft_len or len(c.accept.uniforms) > len(drafts) + 1:
        raise ValueError(f"sequence {c.seq_id}: {len(drafts)} drafts and {len(c.accept.uniforms)} uniforms for an "
                         f"engine that verifies at most {max_draft_len} drafts")
    if c.num_logits != len(drafts) + 1 or list(c.token_ids[len(c.token_ids) - len(drafts):]) != list(drafts):
        raise ValueError(f"sequence {c.seq_id}: a chunk verified in the engine ends with its drafts and asks one "
                         "logits row per draft plus one")


def default_threads(tuned: int | None = None) -> int:
    """Threads when none are asked for: TRTBUILD_NUM_THREADS, else what autotuning chose, else the cores."""
    return int(os.environ.get("TRTBUILD_NUM_THREADS", 0)) or tuned or (os.cpu_count() or 1)


def pack_chunks(chunks: list[SequenceChunk], max_blocks_per_seq: int,
                slots_of: Callable[[Sequence[int], int, int], np.ndarray],
                num_groups: int = 1, lora: bool = False) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """The step inputs every target takes (input_ids, position_ids, query_start_loc, past_lengths, block_tables and
    one more table per KV cache group after the first, logits_indices; with `lora`, lora_ids) for checked chunks,
    packed sequence after sequence, and per group the pool slots of their new K/V (`slots_of(block_ids, start,
    end)`)."""
    block_tables = np.zeros((num_groups, len(chunks), max_blocks_per_seq), dtype=np.int64)
    query_start = np.zeros(len(chunks) + 1, dtype=np.int64)
    query_start[1:] = np.cumsum([len(c.token_ids) for c in chunks])
    positions, logits_rows = [], []
    slots: list[list[np.ndarray]] = [[] for _ in range(num_groups)]
    for i, c in enumerate(chunks):
        end = c.start + len(c.token_ids)
        for g, table in enumerate(c.tables()):
            block_tables[g, i, : len(table)] = table
            slots[g].append(slots_of(table, c.start, end))
        positions.append(np.arange(c.start, end, dtype=np.int64))
        logits_rows.extend(range(query_start[i + 1] - c.num_logits, query_start[i + 1]))
    inputs = {
        "input_ids": np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=query_start[-1]),
        "position_ids": np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64),
        "query_start_loc": query_start,
        "past_lengths": np.array([c.start for c in chunks], dtype=np.int64),
        **{group_input("block_tables", g): block_tables[g] for g in range(num_groups)},
        "logits_indices": np.array(logits_rows, dtype=np.int64),
    }
    if lora:
        inputs[LORA_IDS_INPUT] = np.repeat(np.array([c.lora_id for c in chunks], dtype=np.int64),
                                           np.diff(query_start))
    return inputs, [np.concatenate(s) if s else np.zeros(0, dtype=np.int64) for s in slots]


def accept_feeds(chunks: list[SequenceChunk], max_draft_len: int) -> dict[str, np.ndarray]:
    """The accept op's inputs (network.ACCEPT_INPUTS) of a draft-tokens engine's step: the logits rows of chunks with
    `accept` stay in the engine, all other rows come out."""
    k = max_draft_len
    first_rows = np.cumsum([0] + [c.num_logits for c in chunks])
    verifying = [(i, c.accept) for i, c in enumerate(chunks) if c.accept is not None]
    drafts = np.zeros((len(verifying), k), dtype=np.int64)
    uniforms = np.zeros((len(verifying), k + 1), dtype=np.float64)
    for a, (_, accept) in enumerate(verifying):
        drafts[a, : len(accept.draft_tokens)] = accept.draft_tokens
        uniforms[a, : len(accept.uniforms)] = accept.uniforms
    out_rows = [r for i, c in enumerate(chunks) if c.accept is None
                for r in range(first_rows[i], first_rows[i + 1])]
    return {
        "logits_out_rows": np.array(out_rows, dtype=np.int64),
        "accept_rows": np.array([first_rows[i] for i, _ in verifying], dtype=np.int64),
        "draft_tokens": drafts,
        "draft_lens": np.array([len(a.draft_tokens) for _, a in verifying], dtype=np.int64),
        "temperatures": np.array([a.temperature for _, a in verifying], dtype=np.float64),
        "uniforms": uniforms,
    }


class CpuEngine:
    """An ONNX Runtime session over an engine directory, plus the paged KV pool it reads and the runtime writes."""

    def __init__(self, engine: Path | EngineInfo, num_threads: int | None = None, num_blocks: int = 64,
                 graph: Path | None = None, spinning: bool = True, profile_prefix: str | None = None,
                 rank: int = 0, tp_group: int | None = None) -> None:
        """`engine`: an engine directory, or what read_engine_config said of one (already checked). `num_threads`:
        ONNX Runtime's intra-op threads [None: `default_threads`]. `graph`: another graph file than the engine's
        (the autotuner times candidates). `spinning`: ONNX Runtime's idle threads spin for work. `profile_prefix`:
        ONNX Runtime profiles every node into `<prefix>_<time>.json` (`session.end_profiling()` writes it).
        `rank`, `tp_group`: which rank of a tensor-parallel engine this is, and the id of the channel its ranks meet
        in (runtime/tensor_parallel.py runs all of them)."""
        self.info = engine if isinstance(engine, EngineInfo) else read_engine_config(Path(engine), expect_target="cpu")
        path = Path(graph) if graph is not None else self.info.path / cpu_rank_files(rank)[0]
        tp = self.info.model.mapping.tp_size
        if (tp > 1) != (tp_group is not None):  # NOTE: a rank alone would wait for its peers at the first collective
            raise EngineCompatibilityError(
                f"{self.info.path} is a tensor-parallel engine of {tp} ranks, which `trtbuild run`, `serve`, `bench`, "
                "`eval` and LLM run (runtime/tensor_parallel.py); this tool takes a single-rank engine: build one "
                "from a checkpoint converted with --tp-size 1.")
        self.tp_group = None if tp_group is None else np.array([tp_group], np.int64)
        if not path.is_file():
            raise EngineCompatibilityError(f"{path} is missing; rebuild the engine with `trtbuild build`.")
        # NOTE: ONNX Runtime maps the weight file and repacks each GEMM's weights into buffers of its own (about the
        # file's size); the mapped pages are released after that, so the weights count once, plus working memory.
        # trtbuild::BlockQuantMatMul computes on its (build-time packed) initializers as loaded: no second copy.
        weights = self.info.weight_files.get(cpu_rank_files(rank)[1], self.info.weight_bytes)  # this rank's
        require_memory(weights + LOAD_OVERHEAD_BYTES, f"engine {self.info.path}",
                       "free memory, or build a smaller engine (`trtbuild convert --weight-only int8|int4`, or a "
                       "quantized GGUF file converted as it is).")
        import onnxruntime as ort

        options = ort.SessionOptions()
        # NOTE: one intra-op pool, no inter-op pool: on small machines oversubscribed threads make small GEMMs slow.
        options.intra_op_num_threads = num_threads or default_threads(self.info.tuned_threads)
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # NOTE: no memory pattern: the pattern ONNX Runtime records in a step is one block allocated beside the arena
        # that already holds the first such step's tensors, so every step shape's working memory was held twice
        # (Gemma 3 1B, 2048-token chunks: peak RSS 1722 -> 1398 MiB, prefill and decode speed unchanged).
        options.enable_mem_pattern = False
        options.log_severity_level = 3
        if profile_prefix is not None:
            options.enable_profiling, options.profile_file_prefix = True, profile_prefix
        if not spinning:  # NOTE: a second session in the process (a draft engine) must not spin while the other runs
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # NOTE: ONNX Runtime fuses a weight DequantizeLinear -> MatMul that our lowering left (e.g. no block size fits)
        # into MatMulNBits itself, computing at accuracy level 4 unless told: keep the level the engine was built with.
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level",
                                         str(self.info.build.int4_accuracy_level))
        build = self.info.build
        model = self.info.model
        if "native" in (build.attention, build.quant_linears, build.float_linears) or tp > 1 or \
                model.recurrent_layers:  # trtbuild:: nodes
            options.register_custom_ops_library(str(library_for_engine(self.info.path)))
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own exception types for corrupt or unsupported models
            raise EngineCompatibilityError(f"{path} could not be loaded ({e}); rebuild the engine.") from None
        self.run_seconds = 0.0  # time spent in session.run over all steps (the rest of a step is host work)
        self.kv_quant_algo = self.info.model.quantization.kv_cache_quant_algo
        self.kv_scales = None
        if self.kv_quant_algo:  # per-layer (K, V) scales, stored in the engine file by builder/network.py
            meta = self.session.get_modelmeta().custom_metadata_map.get("trtbuild.kv_cache_scales")
            if meta is None:
                raise EngineCompatibilityError(f"{path} has a {self.kv_quant_algo} KV cache but no KV scales; "
                                               "rebuild the engine.")
            self.kv_scales = np.array(json.loads(meta), dtype=np.float32)
        self.lora_slots = LoraSlotArrays.of(self.session, self.info)
        self.input_names = frozenset(i.name for i in self.session.get_inputs())
        # NOTE: a slot per sequence the engine can batch; the scheduler holds at most that many running
        self.states = RecurrentStateStorage(model, build.max_batch_size) if model.recurrent_layers else None
        self.allocate_kv_cache(num_blocks)

    def allocate_state_snapshots(self, num_snapshots: int) -> None:
        """Room for `num_snapshots` recurrent states kept for prefix reuse (runtime/recurrent_state.py)."""
        self.states.allocate_snapshots(num_snapshots)

    @property
    def can_checkpoint_states(self) -> bool:
        """Whether its recurrent nodes keep states part-way (built with state_checkpoints), as drafts need."""
        return CHECKPOINTS_INPUT in self.input_names

    def allocate_draft_checkpoints(self) -> None:
        """A draft checkpoint per state slot (runtime/recurrent_state.py), for speculative decoding."""
        self.states.allocate_checkpoints()

    def copy_states(self, copies: Sequence[StateCopy]) -> None:
        """Save running sequences' states into snapshots, or restore snapshots into their slots, in order."""
        self.states.copy(copies)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)create the KV pool with `num_blocks` blocks, as the engine's kv_cache input describes it; its
        previous contents are dropped."""
        spec = self.info.kv_cache_input
        _, _, _, kv_heads, tokens_per_block, head_size = spec["shape"]
        dtype = np.dtype(spec["dtype"])
        if dtype != (expected := kv_pool_dtype(self.info.model, self.info.build)):
            raise EngineCompatibilityError(f"{self.info.path}'s kv_cache input is {dtype} but its model and build "
                                           f"configs give a {expected} KV pool; rebuild the engine.")
        self.kv = KVCacheStorage(num_cache_layers(self.info.model), kv_heads, head_size, tokens_per_block, num_blocks,
                                 dtype=dtype, quant_algo=self.kv_quant_algo, scales=self.kv_scales,
                                 groups=self.info.kv_cache_groups)

    @property
    def max_blocks_per_seq(self) -> int:
        return self.info.build.max_blocks_per_seq

    def warm_up(self, max_batch_size: int, max_num_tokens: int) -> None:
        """One dummy step of the most sequences a scheduler may send (limits already within the build's, by
        RuntimeConfig.resolve), one token each: ONNX Runtime's threads, kernels and buffers made ready before the
        first request. NOTE: not a step of max_num_tokens tokens, as vLLM's start-up profile run: on 2 cores that took
        12.8 s for a 0.5B engine (minutes at 8B), and a first 2048-token step after this one ran no slower than the
        ones after it (10.4 s against 10.2 and 11.2 s). It writes only into block 0, before any request owns a block;
        blocks are always written before they are read."""
        num_seqs = max(1, min(max_batch_size, max_num_tokens))
        others = ((0,),) * (len(self.kv.groups) - 1)
        self.step([SequenceChunk(i, [0], 0, 1, (0,), group_block_ids=others, state_slot=i) for i in range(num_seqs)])

    @property
    def max_draft_len(self) -> int:
        """Drafts per sequence the engine verifies itself (SpeculativeAccept); 0: none, it returns logits rows."""
        return self.info.build.max_draft_len

    def step(self, chunks: list[SequenceChunk]) -> np.ndarray:
        """Execute one packed step; returns logits [sum of num_logits, vocab], chunk by chunk in order (chunks with
        `accept`: none, see `execute`)."""
        return self.execute(chunks).logits

    def execute(self, chunks: list[SequenceChunk]) -> StepOutput:
        """Execute one packed step. A step that mixes short and long chunks may run as two engine calls
        (`attention_groups`); the results are the same."""
        check_chunks(self.info.build, chunks, self.max_draft_len, len(self.kv.groups),
                     0 if self.states is None else self.states.num_slots)
        groups = attention_groups(chunks)
        if len(groups) == 1:
            return self._run(chunks)
        rows: dict[int, np.ndarray] = {}
        accepted: dict[int, tuple[int, int]] = {}
        for group in groups:
            out = self._run([chunks[i] for i in group])
            ends = np.cumsum([0 if chunks[i].accept else chunks[i].num_logits for i in group])
            rows.update(zip(group, np.split(out.logits, ends[:-1]), strict=True))
            accepted.update((group[i], result) for i, result in out.accepted.items())
        return StepOutput(np.concatenate([rows[i] for i in range(len(chunks))]), accepted)

    def _run(self, chunks: list[SequenceChunk]) -> StepOutput:
        """One engine call over checked chunks."""
        feeds, slots = self.feeds(chunks)
        start = time.perf_counter()
        outputs = self.session.run(None, feeds)
        self.run_seconds += time.perf_counter() - start
        self.kv.write(outputs[1], slots)
        if not self.max_draft_len:
            return StepOutput(outputs[0], {})
        verifying = [i for i, c in enumerate(chunks) if c.accept is not None]
        results = zip(outputs[2].tolist(), outputs[3].tolist(), strict=True)
        return StepOutput(outputs[0], dict(zip(verifying, results, strict=True)))

    def feeds(self, chunks: list[SequenceChunk]) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
        """The engine inputs of one call over checked chunks (the pool itself as `kv_cache`), and the pool slots
        their new K/V go to."""
        feeds, slots = pack_chunks(chunks, self.max_blocks_per_seq, self.kv.slots, len(self.kv.groups),
                                   lora=bool(self.info.build.num_lora_ids))
        feeds["kv_cache"] = self.kv.pool
        if self.states is not None:  # NOTE: updated in place by the engine's recurrent ops (plugins/gated_delta.py)
            feeds["recurrent_state"] = self.states.states
            feeds["state_slots"] = np.array([c.state_slot for c in chunks], dtype=np.int64)
            if self.can_checkpoint_states:
                feeds[CHECKPOINTS_INPUT] = self.states.checkpoint_feed(chunks)
        if self.lora_slots is not None:
            feeds.update(self.lora_slots.arrays)
        if self.tp_group is not None:
            feeds["tp_group"] = self.tp_group
        if self.max_draft_len:
            feeds.update(accept_feeds(chunks, self.max_draft_len))
        return feeds, slots
