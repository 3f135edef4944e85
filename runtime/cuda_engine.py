"""Run one step of a CUDA engine (builder/build_cuda.py): the plan's kernels over torch tensors on the device, the
paged KV pool a device tensor that each layer's K/V are written into. Same step contract as CpuEngine, so
EngineCore, the scheduler, the sampler and the servers are shared.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors (slow; for tests), with the same plan.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trtbuild.builder.cuda_plan import TORCH_DTYPES, Plan
from trtbuild.builder.engine_dir import EngineInfo, read_engine_config
from trtbuild.configs import LORA_IDS_INPUT, KVCacheGroup, group_input
from trtbuild.errors import EngineCompatibilityError, TrtbuildError
from trtbuild.gpu_kernels.load import load_kernels
from trtbuild.plugins.gated_delta import CHECKPOINTS_INPUT
from trtbuild.runtime.cuda_plan_ops import OPS
from trtbuild.runtime.engine import SequenceChunk, StepOutput, accept_feeds, check_chunks, pack_chunks
from trtbuild.runtime.recurrent_state import DRAFT_CHECKPOINT, StateCopy, checkpoint_feed


class TorchKVPool:
    """pool[block, slot, K|V, kv_head, offset, :] on the device (a slot holds a layer of the block's KV cache group),
    plus one scratch block past `num_blocks` that no sequence owns: padded rows of a CUDA-graph decode batch write
    their K/V there."""

    def __init__(self, shape: list[int], num_blocks: int, dtype: torch.dtype, device: torch.device,
                 groups: tuple[KVCacheGroup, ...]) -> None:
        _, layers, _, kv_heads, tokens_per_block, head_size = shape
        self.groups = groups
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        # NOTE: zeros, not empty: the kernel never reads unwritten slots, but a pool of finite values keeps any
        # debugging dump (and the CPU lowering's contract) sane
        self.pool = torch.zeros((num_blocks + 1, layers, 2, kv_heads, tokens_per_block, head_size), dtype=dtype,
                                device=device)
        self.bytes_per_block = self.pool[0].numel() * self.pool.element_size()

    @property
    def tokens_per_block(self) -> int:
        return self.pool.shape[4]

    def reserve(self) -> None:
        """The pool is allocated (and zeroed) up front; nothing is left to fault in."""

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """pool[destination] = pool[source] for each pair (a beam's fork: KVCacheManager.fork)."""
        if pairs:
            source, destination = zip(*pairs, strict=True)
            self.pool[list(destination)] = self.pool[list(source)]

    def slots(self, block_ids: list[int] | tuple[int, ...], start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        table = np.asarray(block_ids, dtype=np.int64)
        return table[positions // self.tokens_per_block] * self.tokens_per_block + positions % self.tokens_per_block


def _last_uses(plan: Plan) -> list[list[str]]:
    """Per step, the activations read for the last time there (freed after it, so memory follows the live set)."""
    last: dict[str, int] = {}
    for i, step in enumerate(plan.steps):
        for name in step.inputs:
            last[name] = i
    frees: list[list[str]] = [[] for _ in plan.steps]
    for name, i in last.items():
        if name not in plan.outputs:
            frees[i].append(name)
    return frees


class CudaEngine:
    """The plan of a cuda engine directory, its weights on the device and its KV pool."""

    def __init__(self, engine: Path | EngineInfo, num_threads: int | None = None, num_blocks: int = 64) -> None:
        """`engine`: an engine directory, or what read_engine_config said of one (already checked against this GPU
        and stack). `num_threads` is accepted for the CpuEngine signature and unused."""
        self.info = engine if isinstance(engine, EngineInfo) else read_engine_config(Path(engine), "cuda")
        gpu = torch.cuda.is_available()
        self.device = torch.device("cuda" if gpu else "cpu")
        if gpu:
            free, _ = torch.cuda.mem_get_info()
            if self.info.weight_bytes > free:
                raise TrtbuildError(f"engine {self.info.path} needs {self.info.weight_bytes / 2**30:.2f} GiB of GPU "
                                    f"memory for its weights but {free / 2**30:.2f} GiB is free; free GPU memory.")
        self.kernels = load_kernels(interpret=not gpu)
        try:
            self.plan = Plan.load(self.info.graph_file)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise EngineCompatibilityError(f"{self.info.graph_file} cannot be read ({e}); rebuild the engine with "
                                           "`trtbuild build --target cuda`.") from None
        from safetensors.torch import load_file

        self.weights = load_file(str(self.info.path / next(iter(self.info.weight_files))), device=str(self.device))
        self.dtype = TORCH_DTYPES[self.plan.dtype]
        chosen = {name: t["chosen"] for name, t in self.info.tactics.items() if isinstance(t, dict) and "chosen" in t}
        tactic_of = {"paged_attention": "paged_attention", "weight_only_linear": "weight_only_gemm", "moe": "fused_moe"}
        self.step_attrs: list[dict[str, Any]] = [
            {**s.attrs, "tactics": chosen.get(tactic_of.get(s.kernel, ""), {})} for s in self.plan.steps]
        self.frees = _last_uses(self.plan)
        self.run_seconds = 0.0
        # NOTE: CUDA graphs need a GPU (in the interpreter every step runs eagerly), and are not captured for
        # draft-tokens engines yet: their decode steps verify drafts (several rows per sequence) and run eagerly
        self.use_cuda_graphs = gpu and not self.max_draft_len
        self.graphs: dict[int, Any] = {}
        model = self.info.model
        # the recurrent layers' states (runtime/recurrent_state.py), float32, a slot per sequence the engine batches
        # plus a scratch slot for the padded rows of a CUDA-graph decode batch
        self.num_state_slots = self.info.build.max_batch_size if model.recurrent_layers else 0
        self.states = torch.zeros(
            (self.num_state_slots + 1, len(model.recurrent_layers), *model.recurrent_state_shape), dtype=torch.float32,
            device=self.device) if model.recurrent_layers else None
        self.snapshots = None
        self.allocate_kv_cache(num_blocks)

    @property
    def can_checkpoint_states(self) -> bool:
        """Whether its recurrent steps keep states part-way (built with state_checkpoints), as drafts need."""
        return CHECKPOINTS_INPUT in self.plan.inputs

    def allocate_draft_checkpoints(self) -> None:
        """A draft checkpoint per state slot, after the slots and the scratch slot (runtime/recurrent_state.py)."""
        self.states = torch.cat([self.states, torch.zeros_like(self.states[:self.num_state_slots])])

    def allocate_state_snapshots(self, num_snapshots: int) -> None:
        """Room for `num_snapshots` recurrent states kept for prefix reuse (runtime/recurrent_state.py), on the
        device beside the running states."""
        self.snapshots = torch.zeros((num_snapshots, *self.states.shape[1:]), dtype=torch.float32, device=self.device)

    def copy_states(self, copies: Sequence[StateCopy]) -> None:
        """Save running sequences' states into snapshots, or restore snapshots into their slots, in order (in place:
        the captured decode graphs read the same `states`)."""
        for c in copies:
            if c.snapshot == DRAFT_CHECKPOINT:
                self.states[c.slot].copy_(self.states[self.num_state_slots + 1 + c.slot])
            elif c.save:
                self.snapshots[c.snapshot].copy_(self.states[c.slot])
            else:
                self.states[c.slot].copy_(self.snapshots[c.snapshot])

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)create the KV pool with `num_blocks` blocks; its previous contents and captured graphs are dropped."""
        self.graphs.clear()
        # NOTE: an int8 KV cache (the checkpoint's kv_cache_quant_algo) holds int8 values; a float one the compute dtype
        quantized = self.info.model.quantization.kv_cache_quant_algo == "int8"
        self.kv = TorchKVPool(self.info.kv_cache_input["shape"], num_blocks, torch.int8 if quantized else self.dtype,
                              self.device, self.info.kv_cache_groups)

    @property
    def max_blocks_per_seq(self) -> int:
        return self.info.build.max_blocks_per_seq

    @property
    def max_draft_len(self) -> int:
        """Drafts per sequence the engine verifies itself (SpeculativeAccept); 0: none, it returns logits rows."""
        return self.info.build.max_draft_len

    def warm_up(self, max_batch_size: int, max_num_tokens: int) -> None:
        """One step of the largest batch (as CpuEngine.warm_up: allocator and kernels ready before requests), then
        the decode CUDA graphs captured, one per batch-size bucket up to max_batch_size (GPU only). It writes
        only into block 0 and the scratch block, before any request owns a block."""
        b = self.info.build
        num_seqs = max(1, min(max_batch_size, max_num_tokens))
        per_seq = min(max_num_tokens // num_seqs, b.max_seq_len)
        blocks = (0,) * -(-per_seq // b.tokens_per_block)
        others = (blocks,) * (len(self.kv.groups) - 1)
        self.step([SequenceChunk(i, [0] * per_seq, 0, 1, blocks, group_block_ids=others, state_slot=i)
                   for i in range(num_seqs)])
        if self.use_cuda_graphs:
            from trtbuild.runtime.cuda_graphs import batch_buckets

            for size in batch_buckets(max_batch_size):
                self._graph(size)

    def step(self, chunks: list[SequenceChunk]) -> np.ndarray:
        return self.execute(chunks).logits

    def execute(self, chunks: list[SequenceChunk]) -> StepOutput:
        """One packed step: logits rows of every chunk without `accept`, in order, and the accept results of those
        with it (only those rows and results leave the device)."""
        check_chunks(self.info.build, chunks, self.max_draft_len, len(self.kv.groups), self.num_state_slots)
        start = time.perf_counter()
        rows = sum(c.num_logits for c in chunks)
        decode = all(len(c.token_ids) == 1 and c.num_logits == 1 for c in chunks)
        if self.use_cuda_graphs and decode:
            from trtbuild.runtime.cuda_graphs import bucket_for

            size = bucket_for(len(chunks), self.info.build.max_batch_size)
            outputs = {"logits": self._graph(size).run(self.inputs(chunks, pad_to=size))}
        else:
            outputs = self.forward(self.inputs(chunks), max(len(c.token_ids) for c in chunks))
        if self.max_draft_len:
            rows -= sum(c.num_logits for c in chunks if c.accept is not None)
        out = outputs["logits"][:rows].float().cpu().numpy()  # NOTE: syncs; the rows asked for, nothing else
        accepted = {}
        if self.max_draft_len:
            verifying = [i for i, c in enumerate(chunks) if c.accept is not None]
            results = zip(outputs["num_accepted"].tolist(), outputs["next_tokens"].tolist(), strict=True)
            accepted = dict(zip(verifying, results, strict=True))
        self.run_seconds += time.perf_counter() - start
        return StepOutput(out, accepted)

    def _graph(self, size: int):
        if size not in self.graphs:
            from trtbuild.runtime.cuda_graphs import DecodeGraph

            self.graphs[size] = DecodeGraph(self, size)
        return self.graphs[size]

    def inputs(self, chunks: list[SequenceChunk], pad_to: int | None = None) -> dict[str, torch.Tensor]:
        """The plan's inputs (plan.inputs) of checked chunks, on the device. `pad_to`: a decode batch padded with
        one-token sequences in the scratch block (for a CUDA graph of that batch size)."""
        groups = range(len(self.kv.groups))
        host, slots = pack_chunks(chunks, self.max_blocks_per_seq, self.kv.slots, len(groups),
                                  lora=bool(self.info.build.num_lora_ids))
        pad = 0 if pad_to is None else pad_to - len(chunks)
        if pad:  # one-token sequences at position 0 whose only block (in every group) is the scratch block
            scratch, tokens = self.kv.scratch_block, len(host["input_ids"])
            padded_tables = np.full((pad, self.max_blocks_per_seq), scratch, dtype=np.int64)
            for g in groups:
                name = group_input("block_tables", g)
                host[name] = np.concatenate([host[name], padded_tables])
                slots[g] = np.concatenate([slots[g], np.full(pad, scratch * self.kv.tokens_per_block, dtype=np.int64)])
            host["query_start_loc"] = np.concatenate([host["query_start_loc"], tokens + np.arange(1, pad + 1)])
            for name in ("input_ids", "position_ids", "past_lengths", LORA_IDS_INPUT):
                if name in host:
                    host[name] = np.concatenate([host[name], np.zeros(pad, dtype=np.int64)])
            host["logits_indices"] = np.concatenate([host["logits_indices"], tokens + np.arange(pad)])
        host.update((group_input("slot_mapping", g), slots[g]) for g in groups)
        if self.states is not None:  # NOTE: padded rows share the scratch slot (past 0: nothing is read from it)
            host["state_slots"] = np.array([c.state_slot for c in chunks] + [self.num_state_slots] * pad,
                                           dtype=np.int64)
            keep = [c.state_checkpoint for c in chunks] + [0] * pad
            if any(keep) and len(self.states) == self.num_state_slots + 1:
                raise ValueError("a chunk keeps its state for drafts, but the engine has no draft checkpoints")
            host[CHECKPOINTS_INPUT] = checkpoint_feed(host["state_slots"], keep, self.num_state_slots + 1)
        if self.max_draft_len:
            host.update(accept_feeds(chunks, self.max_draft_len))
        return {name: torch.from_numpy(host[name]).to(self.device, non_blocking=True) for name in self.plan.inputs}

    def forward(self, inputs: dict[str, torch.Tensor], max_query_len: int) -> dict[str, torch.Tensor]:
        """Every plan step in order over `inputs`; returns the plan's outputs on the device: logits [rows, vocab]
        (compute dtype), and num_accepted, next_tokens [A] in draft-tokens engines. Free of host syncs, so a CUDA
        graph can capture it."""
        env: dict[str, torch.Tensor] = dict(inputs)
        env["kv_cache"] = self.kv.pool
        if self.states is not None:
            env["recurrent_state"] = self.states
        weights = self.weights
        for step, attrs, frees in zip(self.plan.steps, self.step_attrs, self.frees, strict=True):
            args = [env[n] if n in env else weights[n] for n in step.inputs]
            if step.kernel in ("paged_attention", "short_conv"):
                attrs = {**attrs, "max_query_len": max_query_len}
            env.update(zip(step.outputs, OPS[step.kernel](self.kernels, attrs, *args), strict=True))
            for name in frees:
                if name not in inputs and name not in ("kv_cache", "recurrent_state"):
                    env.pop(name, None)
        return {name: env[name] for name in self.plan.outputs}
