"""Run one step of a TensorRT engine (builder/tensorrt/build.py): the serialized engine deserialized with our plugins
registered, one execution context per optimization profile, device buffers from torch, the paged KV pool a device
tensor. Same step contract as CpuEngine: the engine returns logits rows and new_kv, and the new K/V are scattered
into the pool after the step. Written against TensorRT 10's runtime API; it has never run (no TensorRT here)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trtbuild.builder.engine_dir import EngineInfo, read_engine_config
from trtbuild.builder.tensorrt.plan import Profile, max_pool_blocks, profile_for
from trtbuild.errors import EngineCompatibilityError
from trtbuild.runtime.cuda_engine import TorchKVPool
from trtbuild.runtime.engine import SequenceChunk, StepOutput, check_chunks, pack_chunks

INPUTS = ("input_ids", "position_ids", "query_start_loc", "past_lengths", "block_tables", "logits_indices")


def _profiles(info: EngineInfo) -> list[Profile]:
    shapes = info.tactics.get("profiles", [])
    return [Profile(p["name"], {k: tuple(tuple(s) for s in v) for k, v in p["shapes"].items()}) for p in shapes]


class TensorRTEngine:
    """The rank0.engine of a tensorrt engine directory, its execution contexts and its KV pool."""

    def __init__(self, engine: Path | EngineInfo, num_threads: int | None = None, num_blocks: int = 64) -> None:
        """`engine`: an engine directory, or what read_engine_config said of one (checked against this GPU and
        TensorRT version). `num_threads` is accepted for the CpuEngine signature and unused."""
        import tensorrt as trt

        from trtbuild.builder.tensorrt.build import _logger
        from trtbuild.plugins.tensorrt import register_all

        self.info = engine if isinstance(engine, EngineInfo) else read_engine_config(Path(engine), "tensorrt")
        self.device = torch.device("cuda")
        self.profiles = _profiles(self.info)
        if not self.profiles:
            raise EngineCompatibilityError(f"{self.info.path}/config.json lists no optimization profiles; rebuild "
                                           "the engine with `trtbuild build --target tensorrt`.")
        register_all()  # NOTE: before deserializing: the engine names our plugins
        self.runtime = trt.Runtime(_logger(trt))
        self.engine = self.runtime.deserialize_cuda_engine(self.info.graph_file.read_bytes())
        if self.engine is None:
            raise EngineCompatibilityError(f"TensorRT could not deserialize {self.info.graph_file}; rebuild it with "
                                           "`trtbuild build --target tensorrt`.")
        self.stream = torch.cuda.Stream()
        self.contexts: list[Any] = []
        for i in range(len(self.profiles)):
            context = self.engine.create_execution_context()
            context.set_optimization_profile_async(i, self.stream.cuda_stream)
            self.contexts.append(context)
        self.run_seconds = 0.0
        self.allocate_kv_cache(num_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)create the KV pool; a profile bounds its block count (EngineCore caps its budget there)."""
        cap = max_pool_blocks(self.info.build)
        if num_blocks > cap:
            raise ValueError(f"a KV pool of {num_blocks} blocks exceeds the engine's profile maximum {cap} "
                             "(max_batch_size x max_blocks_per_seq)")
        self.kv = TorchKVPool(self.info.kv_cache_input["shape"], num_blocks, torch.float32, self.device,
                              self.info.kv_cache_groups)

    @property
    def max_blocks_per_seq(self) -> int:
        return self.info.build.max_blocks_per_seq

    @property
    def max_draft_len(self) -> int:
        return 0  # NOTE: the tensorrt target refuses draft-tokens builds; drafts are verified from logits rows

    def warm_up(self, max_batch_size: int, max_num_tokens: int) -> None:
        """One step of the largest batch (as CpuEngine.warm_up), writing only into block 0 before any request
        owns a block."""
        b = self.info.build
        num_seqs = max(1, min(max_batch_size, max_num_tokens))
        per_seq = min(max_num_tokens // num_seqs, b.max_seq_len)
        blocks = [0] * -(-per_seq // b.tokens_per_block)
        self.step([SequenceChunk(i, [0] * per_seq, 0, 1, blocks) for i in range(num_seqs)])

    def step(self, chunks: list[SequenceChunk]) -> np.ndarray:
        return self.execute(chunks).logits

    def execute(self, chunks: list[SequenceChunk]) -> StepOutput:
        check_chunks(self.info.build, chunks, self.max_draft_len)
        # NOTE: one KV cache group: the tensorrt target refuses sliding windows shorter than the engine
        host, (slots,) = self.feeds(chunks)
        start = time.perf_counter()
        logits, new_kv = self.run(host)
        # new_kv [L, 2, T, KVH, D] -> pool[block, L, K|V, KVH, offset, :]
        bs = self.kv.tokens_per_block
        slots_t = torch.from_numpy(slots).to(self.device)
        self.kv.pool[slots_t // bs, :, :, :, slots_t % bs] = new_kv.permute(2, 0, 1, 3, 4)
        out = logits.cpu().numpy()
        self.run_seconds += time.perf_counter() - start
        return StepOutput(out, {})

    def feeds(self, chunks: list[SequenceChunk]) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
        """The engine inputs of one step (CpuEngine's, less the pool) and the pool slots of its new K/V."""
        return pack_chunks(chunks, self.max_blocks_per_seq, self.kv.slots, lora=bool(self.info.build.num_lora_ids))

    def run(self, host: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """execute_async_v3 under the first profile that admits the step; returns logits and new_kv (device)."""
        tokens, seqs = len(host["input_ids"]), len(host["past_lengths"])
        context = self.contexts[profile_for(self.profiles, tokens, seqs)]
        tensors = {name: torch.from_numpy(host[name]).to(self.device) for name in INPUTS}
        tensors["kv_cache"] = self.kv.pool[: self.kv.num_blocks]  # NOTE: the scratch block stays outside
        for name, t in tensors.items():
            context.set_input_shape(name, tuple(t.shape))
        m = self.info.model
        outputs = {
            "logits": torch.empty((len(host["logits_indices"]), m.vocab_size), dtype=torch.float32,
                                  device=self.device),
            "new_kv": torch.empty((m.num_hidden_layers, 2, tokens, m.num_key_value_heads, m.head_size),
                                  dtype=torch.float32, device=self.device),
        }
        for name, t in {**tensors, **outputs}.items():
            context.set_tensor_address(name, t.data_ptr())
        self.stream.wait_stream(torch.cuda.current_stream())
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT's execute_async_v3 failed (its log says why)")
        torch.cuda.current_stream().wait_stream(self.stream)
        return outputs["logits"], outputs["new_kv"]
