"""The `trtbuild::SpeculativeAccept` contract: the CPU lowering (builder/lower_accept.py) against the numpy
reference, the reference against runtime/speculative.verify (same uniforms, same tokens), and rejection sampling in
the lowered op keeping the target distribution."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from trtbuild.builder.graph import GraphBuilder
from trtbuild.builder.lower_accept import lower_speculative_accept
from trtbuild.plugins import speculative_accept as sa
from trtbuild.runtime.sampling import SamplingParams, SamplingState
from trtbuild.runtime.speculative import verify

K, VOCAB = 4, 12


def accept_model(k: int = K, vocab: int = VOCAB) -> onnx.ModelProto:
    g = GraphBuilder()
    i64 = TensorProto.INT64
    inputs = [g.input("logits", TensorProto.FLOAT, ["N", vocab]), g.input("accept_rows", i64, ["A"]),
              g.input("draft_tokens", i64, ["A", k]), g.input("draft_lens", i64, ["A"]),
              g.input("temperatures", TensorProto.DOUBLE, ["A"]),
              g.input("uniforms", TensorProto.DOUBLE, ["A", k + 1])]
    g.op(sa.OP_TYPE, inputs, domain=sa.DOMAIN, outputs=list(sa.OUTPUTS), name="accept", max_draft_len=k)
    for name in sa.OUTPUTS:
        g.output(name, i64, ["A"])
    model = g.model("accept", {sa.DOMAIN: sa.OPSET_VERSION})
    onnx.checker.check_model(model, full_check=True)
    assert lower_speculative_accept(model) == 1
    onnx.checker.check_model(model, full_check=True)
    assert sa.DOMAIN not in {o.domain for o in model.opset_import}
    return model


@pytest.fixture(scope="module")
def session() -> ort.InferenceSession:
    return ort.InferenceSession(accept_model().SerializeToString(), providers=["CPUExecutionProvider"])


def batch(rng: np.random.Generator, lens: list[int], temperatures: list[float], agree: float = 0.6) -> dict:
    """Rows of every sequence packed after a few unrelated rows (a prefill's), drafts that often match the argmax."""
    rows, starts, drafts = [rng.normal(size=(3, VOCAB)) * 2], [], np.zeros((len(lens), K), dtype=np.int64)
    offset = 3
    for a, n in enumerate(lens):
        logits = rng.normal(size=(n + 1, VOCAB)) * 4
        for i in range(n):
            drafts[a, i] = np.argmax(logits[i]) if rng.random() < agree else rng.integers(VOCAB)
        rows.append(logits)
        starts.append(offset)
        offset += n + 1
    rows.append(rng.normal(size=(2, VOCAB)))
    return dict(logits=np.concatenate(rows).astype(np.float32), accept_rows=np.array(starts, dtype=np.int64),
                draft_tokens=drafts, draft_lens=np.array(lens, dtype=np.int64),
                temperatures=np.array(temperatures, dtype=np.float64), uniforms=rng.random((len(lens), K + 1)))


LENS = [2, 0, 4, 1, 3, 4]


@pytest.mark.parametrize("temperatures", [[0.0] * 6, [1.0] * 6, [0.7, 1.0, 0.0, 1.3, 0.0, 0.5]],
                         ids=["greedy", "sampling", "mixed"])
def test_lowering_matches_reference(session, temperatures):
    rng = np.random.default_rng(0)
    outcomes = set()
    for _ in range(30):
        data = batch(rng, LENS, temperatures, agree=0.8)
        want = sa.reference_speculative_accept(**data)
        got = session.run(list(sa.OUTPUTS), data)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        outcomes.update(zip(data["draft_lens"].tolist(), want[0].tolist(), strict=True))
    assert {(4, 0), (4, 4), (2, 1), (0, 0)} <= outcomes  # rejected at once, all accepted, in between, no drafts


def test_an_empty_batch_runs(session):
    data = batch(np.random.default_rng(1), [], [])
    assert [x.shape for x in session.run(list(sa.OUTPUTS), data)] == [(0,), (0,)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_reference_gives_python_verification_tokens_from_the_same_stream(temperature):
    """verify() draws from the request's generator; the op reads the same numbers as uniforms and says how far the
    stream advanced."""
    rng = np.random.default_rng(5)
    for seed in range(200):
        data = batch(rng, [3], [temperature], agree=0.8)
        if seed % 4 == 0:  # a draft the target gives probability 0
            data["logits"][3 + seed // 4 % 3, data["draft_tokens"][0, seed // 4 % 3]] = -np.inf
        state = SamplingState(SamplingParams(temperature=temperature, seed=seed), [1, 2])
        data["uniforms"] = np.random.default_rng(seed).random((1, K + 1))
        verified = verify(data["logits"][3:7], data["draft_tokens"][0, :3].tolist(), state)
        n, token = (x[0] for x in sa.reference_speculative_accept(**data))
        assert verified.token_ids == data["draft_tokens"][0, :n].tolist() + [token]
        if temperature:
            follower = np.random.default_rng(seed)
            follower.random(sa.uniforms_used(int(n), 3))
            assert state.rng.random() == follower.random()


def test_rejection_sampling_in_the_op_keeps_the_target_distribution(session):
    """Thousands of seeded trials on a 4-token vocabulary, drafts likely, unlikely and impossible: the first token
    is distributed as p = softmax(logits / T) (chi-square, 3 degrees of freedom, p-value > 1e-3) and the draft is
    accepted with probability p(draft)."""
    temperature, trials = 0.9, 8000
    logits = np.full((2, VOCAB), -np.inf, dtype=np.float32)
    logits[:, :4] = [2.0, 1.5, 0.5, -1.0]
    p = np.exp(logits[0, :4] / temperature)
    p /= p.sum()
    for draft in (0, 3, 7):  # likely, unlikely, probability 0
        rng = np.random.default_rng(draft)
        data = dict(logits=np.tile(logits, (trials, 1)), accept_rows=np.arange(0, 2 * trials, 2),
                    draft_tokens=np.full((trials, K), draft, dtype=np.int64), draft_lens=np.ones(trials, np.int64),
                    temperatures=np.full(trials, temperature), uniforms=rng.random((trials, K + 1)))
        num_accepted, next_tokens = session.run(list(sa.OUTPUTS), data)
        first = np.where(num_accepted == 1, draft, next_tokens)
        counts = np.bincount(first, minlength=VOCAB)
        assert counts[4:].sum() == 0
        chi2 = ((counts[:4] - trials * p) ** 2 / (trials * p)).sum()
        assert chi2 < 16.27, (draft, counts, trials * p)  # the 0.999 quantile of chi-square with 3 dof
        p_draft = p[draft] if draft < 4 else 0.0
        assert abs(num_accepted.mean() - p_draft) < 4 * np.sqrt(max(p_draft * (1 - p_draft), 1e-9) / trials) + 1e-9
