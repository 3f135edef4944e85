"""Embedding engines (`trtbuild build --task embed`): each prompt's last-token final hidden state, L2-normalized, as
Hugging Face's model gives it (last-token pooling, as Qwen3-Embedding pools); batched, chunked and prefix-cached
prompts; OpenAI's /v1/embeddings on a real server; what an embed engine and a generating one refuse."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from helpers import make_random_hf_model
from test_openai import Server

from trtbuild.errors import ConfigError
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(20, 60))]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_random_hf_model("qwen3", tmp_path_factory.mktemp("embed") / "hf")


@pytest.fixture(scope="module")
def embed_engine(qwen3, engine_from_hf):
    return engine_from_hf(qwen3, task="embed", max_batch_size=4, max_num_tokens=32)


def hf_embeddings(hf_dir, prompts) -> list[np.ndarray]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            h = model(torch.tensor([p])).last_hidden_state[0, -1].numpy()
        out.append(h / np.linalg.norm(h))
    return out


def test_embeddings_are_hugging_faces_last_token_states_batched_chunked_and_cached(qwen3, embed_engine):
    want = hf_embeddings(qwen3, PROMPTS)
    llm = LLM(embed_engine, RuntimeConfig(max_prefill_chunk=8, warm_up=False))  # the 40-token prompt in 5 chunks
    for got in (llm.embed(PROMPTS), llm.embed(PROMPTS[::-1])[::-1]):  # the second run reads cached prefix blocks
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and np.abs(g - w).max() < 1e-5
    assert llm.core.kv.pool.num_free == llm.core.kv.pool.num_blocks


def test_a_base_model_saved_without_its_head_builds_an_embed_engine(tmp_path, engine_from_hf):
    """Embedding models are often saved as their base model (Qwen3Model: no `model.` prefix, no lm_head): tied, the
    checkpoint has the head anyway; untied, it has none (has_lm_head false) and builds only with --task embed."""
    import json

    from transformers import AutoModel

    from trtbuild.builder.build import build_engine
    from trtbuild.builder.convert.convert import convert
    from trtbuild.errors import TrtbuildError

    for tied in (True, False):
        full = make_random_hf_model("qwen3", tmp_path / f"full_{tied}", overrides={"tie_word_embeddings": tied})
        base = tmp_path / f"base_{tied}"
        AutoModel.from_pretrained(full).save_pretrained(base)
        for f in full.glob("tokenizer*"):
            (base / f.name).write_bytes(f.read_bytes())
        engine = engine_from_hf(base, task="embed")
        (got,) = LLM(engine, RuntimeConfig(warm_up=False)).embed(PROMPTS[:1])
        (want,) = hf_embeddings(base, PROMPTS[:1])
        assert np.abs(got - want).max() < 1e-5
    convert(tmp_path / "base_False", tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["has_lm_head"] is False
    with pytest.raises(TrtbuildError, match="the checkpoint has no LM head .* build it with --task embed"):
        build_engine(tmp_path / "ckpt", tmp_path / "engine")
    assert not (tmp_path / "engine").exists()


def test_an_embed_engine_embeds_and_a_generating_engine_generates(embed_engine, llama_engine):
    with pytest.raises(ValueError, match="this engine embeds"):
        LLM(embed_engine, RuntimeConfig(warm_up=False)).generate([[1, 2]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="embeddings need an engine built with `--task embed`"):
        LLM(llama_engine, RuntimeConfig(warm_up=False)).embed([[1, 2]])
    with pytest.raises(ConfigError, match="embed builds for the cpu target"):
        from trtbuild.configs import BuildConfig

        BuildConfig(target="cuda", task="embed")


def test_verify_holds_an_embed_engines_hidden_states_to_the_logits_tolerance(embed_engine):
    from trtbuild.bench.verify import verify_engine

    report = verify_engine(embed_engine, embed_engine.parent / "ckpt")
    assert [o.name for o in report.outputs] == ["hidden_states", "new_kv"] and all(o.passed for o in report.outputs)


def test_openai_embeddings_endpoint(qwen3, embed_engine, llama_engine):
    want = hf_embeddings(qwen3, PROMPTS)
    server = Server(embed_engine)
    try:
        code, body = server.post("/v1/embeddings", {"model": "stories", "input": PROMPTS})
        assert code == 200, body
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        for d, w in zip(body["data"], want, strict=True):
            assert np.abs(np.array(d["embedding"]) - w).max() < 1e-5
        assert body["usage"] == {"prompt_tokens": sum(map(len, PROMPTS)), "total_tokens": sum(map(len, PROMPTS))}
        # the official client asks for base64 float32; `dimensions` cuts and normalizes again
        r = server.client().embeddings.create(model="stories", input=PROMPTS[0], dimensions=16)
        cut = want[0][:16] / np.linalg.norm(want[0][:16])
        assert np.abs(np.array(r.data[0].embedding) - cut).max() < 1e-5
        code, body = server.post("/v1/embeddings", {"input": [PROMPTS[1]], "encoding_format": "base64"})
        assert np.abs(np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4") - want[1]).max() < 1e-5
        for bad, message in [({"input": [[1, 2], [1, 99999]]}, "outside the vocabulary"),
                             ({"input": [1], "dimensions": 65}, "dimensions must be in [1, 64]"),
                             ({"input": []}, "prompt")]:
            code, doc = server.post("/v1/embeddings", bad)
            assert code == 400 and message in doc["error"]["message"], doc
        code, doc = server.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
        assert code == 400 and "this engine embeds" in doc["error"]["message"]
    finally:
        server.stop()
    generating = Server(llama_engine)
    try:
        code, doc = generating.post("/v1/embeddings", {"input": [1, 2]})
        assert code == 400 and "embeddings need an engine built with" in doc["error"]["message"]
    finally:
        generating.stop()


def test_grpc_embed_rpc(qwen3, embed_engine, tmp_path):
    import grpc
    from test_server import Server as GrpcServer

    want = hf_embeddings(qwen3, PROMPTS[:1])[0]
    server = GrpcServer(embed_engine, tmp_path / "log")
    try:
        client = server.client()
        assert client.model_info().task == "embed"
        out = client.embed(PROMPTS[0], timeout=60)
        assert np.abs(np.array(out.embedding) - want).max() < 1e-5 and out.usage.prompt_tokens == len(PROMPTS[0])
        with pytest.raises(grpc.RpcError) as e:
            client.generate(PROMPTS[0], timeout=60, max_tokens=2)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "this engine embeds" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            client.stub.Embed(client_request(PROMPTS[0]), timeout=60)
        assert "sampling: an embedding request samples nothing" in e.value.details()
    finally:
        server.stop()


def client_request(prompt):
    from trtbuild.serving.grpc.client import make_request

    return make_request(prompt, max_tokens=3)  # with sampling options set

