"""Continuous batching on CPU (``cpu_engine.hf_generate``): concurrent requests share decoding
steps and still get exactly what one-at-a-time generation gives them — same tokens, log-probs
equal to the uncached model's within float tolerance — on Qwen3.5 hybrid models (Gated DeltaNet
linear-attention layers + full-attention layers whose KV rows are left-padded in the batch)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3_5TextConfig
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

from cpu_engine.cache_rows import FULL, LINEAR, SPARE_COLUMNS, AppendLayer, CacheRows
from cpu_engine.hf_generate import HFGenerator, prefill_groups
from cpu_engine.prefix_cache import PrefixCache, Snapshot
from cpu_engine.sampling import SamplingSpec, sample_rows

ATOL = 1e-4  # fp32 log-probs of a 4,096-token vocabulary agree to ~1e-6


@pytest.fixture(scope="module")
def alternating_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A text-only Qwen3.5 with layers linear, full, linear, full (the tiny model is 3 linear + 1 full)."""
    out = tmp_path_factory.mktemp("alternating_qwen35")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=[LINEAR, FULL, LINEAR, FULL],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    Qwen3_5ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["tiny", "alternating"])
def model_dir(request: pytest.FixtureRequest, tiny_model_dir: Path, alternating_model_dir: Path) -> str:
    return str(tiny_model_dir if request.param == "tiny" else alternating_model_dir)


@pytest.fixture(scope="module")
def pair(model_dir: str):
    """(batched generator, one-at-a-time generator) on the same weights and seed."""
    batched = HFGenerator(model_dir, max_new_tokens=12, seed=3, max_batch_size=16)
    single = HFGenerator(model_dir, max_new_tokens=12, seed=3, max_batch_size=1, prefix_cache_mb=0)
    yield batched, single
    batched.close()
    single.close()


def _prompts(seed: int, count: int, low: int = 3, high: int = 300) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(3, 4096) for _ in range(rnd.randrange(low, high))] for _ in range(count)]


PARAMS = [
    {"temperature": 0.0},
    {"temperature": 1.0, "max_tokens": 5},
    {"temperature": 0.7, "top_k": 20},
    {"temperature": 1.3, "top_p": 0.8, "top_k": -1},
    {"temperature": 1.0, "max_tokens": 1},
    {"temperature": 0, "top_p": 0.5, "max_tokens": 9},
]


def _assert_same(out, ref, generator: HFGenerator, prompt: list[int]) -> None:
    assert out.token_ids == ref.token_ids
    assert torch.allclose(torch.tensor(out.log_probs), torch.tensor(ref.log_probs), atol=ATOL)
    uncached = generator.score(prompt, out.token_ids)
    assert torch.allclose(torch.tensor(out.log_probs), torch.tensor(uncached), atol=ATOL)


@pytest.mark.slow
def test_concurrent_requests_match_one_at_a_time_and_the_uncached_model(pair):
    batched, single = pair
    prompts = _prompts(0, 12)  # 3..300 tokens: the full-attention rows are padded up to ~300 columns
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    before = batched.stats()
    with batched._cv:  # all queued before the engine admits any: one admission, batched prefills
        futures = [batched.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    outs = [f.result(timeout=300) for f in futures]
    after = batched.stats()
    refs = [single.generate(p, q) for p, q in zip(prompts, params, strict=True)]
    for prompt, out, ref, q in zip(prompts, outs, refs, params, strict=True):
        assert 1 <= len(out.token_ids) <= q.get("max_tokens", 12) and out.stop_reason == "completed"
        _assert_same(out, ref, batched, prompt)
    steps = after["decode_steps"] - before["decode_steps"]
    assert after["decoded_rows"] - before["decoded_rows"] >= 3 * steps  # really decoded together
    calls = after["prefill_calls"] - before["prefill_calls"]
    assert after["prefill_rows"] - before["prefill_rows"] == len(prompts) > calls  # prefilled together


def test_requests_join_and_leave_a_running_batch(pair):
    """Requests arriving while others decode join between steps; what each gets does not depend
    on who it shared steps with."""
    batched, single = pair
    early, late = _prompts(1, 2, 50, 120), _prompts(2, 3, 3, 200)
    long = {"temperature": 1.0, "max_tokens": 12}
    start = batched.stats()["decode_steps"]  # before the submits: the early rows may finish at once
    first = [batched.submit(p, long) for p in early]
    deadline = time.monotonic() + 120
    while (
        batched.stats()["decode_steps"] < start + 3
        and not all(f.done() for f in first)  # all stopped (EOS) before a third step: join now
        and time.monotonic() < deadline
    ):
        time.sleep(0.001)
    second = [batched.submit(p, {"temperature": 0.9, "max_tokens": 4}) for p in late]
    outs = [f.result(timeout=300) for f in first + second]
    refs = [single.generate(p, long) for p in early] + [
        single.generate(p, {"temperature": 0.9, "max_tokens": 4}) for p in late
    ]
    for prompt, out, ref in zip(early + late, outs, refs, strict=True):
        _assert_same(out, ref, batched, prompt)


def test_multi_turn_prompts_reuse_cached_states(pair):
    """Each turn extends the previous prompt + its answer (+ a tool turn); GRPO siblings share a
    prompt. Cached states are reused, and the outputs stay those of full prefills."""
    batched, single = pair
    rnd = random.Random(5)
    base = _prompts(3, 2, 100, 200)
    prompts = [base[0]] * 3 + [base[1]] * 2  # two groups of siblings
    params = {"temperature": 1.0, "max_tokens": 6}
    before_b, before_s = batched.stats(), single.stats()
    for _ in range(3):
        with batched._cv:  # admitted together: continuations of different states share a prefill
            futures = [batched.submit(p, params) for p in prompts]
        outs = [f.result(timeout=300) for f in futures]
        refs = [single.generate(p, params) for p in prompts]
        for prompt, out, ref in zip(prompts, outs, refs, strict=True):
            _assert_same(out, ref, batched, prompt)
        tool = [[rnd.randrange(3, 4096) for _ in range(rnd.randrange(1, 40))] for _ in prompts]
        tool[-1] = []  # a continuation whose new part is one token (the turn's last)
        prompts = [p + o.token_ids + t for p, o, t in zip(prompts, outs, tool, strict=True)]
    after_b, after_s = batched.stats(), single.stats()
    assert after_b["reused_tokens"] > before_b["reused_tokens"]
    prefilled_b = after_b["prefill_tokens"] - before_b["prefill_tokens"]
    prefilled_s = after_s["prefill_tokens"] - before_s["prefill_tokens"]
    assert prefilled_b < prefilled_s / 3


def _close(a: CacheRows, b: CacheRows) -> bool:
    """Same kinds, widths and tensors (float tolerance): two states of one sequence."""
    if a.kinds != b.kinds or a.width != b.width or a.mask.tolist() != b.mask.tolist():
        return False
    return all(
        torch.allclose(x, y, atol=1e-5, rtol=1e-4)
        for i, kind in enumerate(a.kinds)
        for x, y in zip(a._used(i), b._used(i), strict=True)
    )


def test_batched_prefill_equals_prefilling_each_sequence_alone(model_dir):
    """One forward pass over right-padded sequences of different lengths (1-299 new tokens),
    fresh prompts and continuations of cached states mixed, gives each sequence the state and
    next-token logits it gets alone, and those are the uncached model's."""
    generator = HFGenerator(model_dir, max_new_tokens=4, seed=0)
    blank = generator._blank

    def uncached(tokens: tuple[int, ...]) -> torch.Tensor:
        return torch.log_softmax(generator.model(input_ids=torch.tensor([tokens])).logits[0, -1].float(), -1)

    def check(starts: list[CacheRows], new: list[tuple[int, ...]], full: list[tuple[int, ...]]) -> None:
        together = generator._prefill(starts, new)
        for start, tokens, sequence, (rows, logits) in zip(starts, new, full, together, strict=True):
            alone_rows, alone_logits = generator._prefill([start], [tokens])[0]
            assert rows.width == len(sequence) and rows.lengths() == [len(sequence)]  # real tokens only
            assert _close(rows, alone_rows)
            log_probs = torch.log_softmax(logits, -1)
            assert torch.allclose(log_probs, torch.log_softmax(alone_logits, -1), atol=ATOL)
            assert torch.allclose(log_probs, uncached(sequence), atol=ATOL)

    try:
        with torch.inference_mode():
            prompts = [tuple(p) for p in _prompts(12, 6, 2, 300)] + [(11,)]  # and a 1-token prompt
            check([blank] * len(prompts), prompts, prompts)
            states = [rows for rows, _ in generator._prefill([blank] * len(prompts), prompts)]
            tails = [tuple(t) for t in _prompts(13, len(prompts), 2, 120)]
            tails[0] = tails[0][:1]  # a continuation of one token
            continuing = [i % 3 != 2 for i in range(len(prompts))]  # every third row starts fresh
            starts = [states[i] if c else blank for i, c in enumerate(continuing)]
            new = [tails[i] if c else prompts[i] + tails[i] for i, c in enumerate(continuing)]
            check(starts, new, [p + t for p, t in zip(prompts, tails, strict=True)])
    finally:
        generator.close()


def test_prefill_groups_bound_padding_and_size():
    assert prefill_groups([10, 300, 290, 12, 1], budget=4096, slack=64) == [[1, 2], [3, 0, 4]]
    assert prefill_groups([100] * 5, budget=250, slack=64) == [[0, 1], [2, 3], [4]]
    assert prefill_groups([5000, 4990], budget=4096, slack=64) == [[0], [1]]  # too long to share
    assert prefill_groups([], budget=4096) == []


def test_identical_prompts_get_distinct_reproducible_streams(tiny_model_dir):
    prompt = _prompts(4, 1, 20, 21)[0]
    params = {"temperature": 1.0, "max_tokens": 10}

    def group(seed: int) -> list[tuple[int, ...]]:
        generator = HFGenerator(str(tiny_model_dir), max_new_tokens=10, seed=seed)
        try:
            return [
                tuple(f.result(timeout=300).token_ids)
                for f in [generator.submit(prompt, params) for _ in range(4)]
            ]
        finally:
            generator.close()

    first, again, other = group(0), group(0), group(1)
    assert len(set(first)) == 4  # siblings do not repeat each other
    assert first == again  # same seed, same streams in submission order
    assert set(other) != set(first)
    generator = HFGenerator(str(tiny_model_dir), max_new_tokens=10, seed=0)
    try:
        seeded = [generator.generate(prompt, {**params, "seed": 11}).token_ids for _ in range(2)]
        assert tuple(generator.generate(prompt, params).token_ids) == first[0]
        generator.load_weights({k: v.clone() for k, v in generator.model.state_dict().items()})
        assert (
            tuple(generator.generate(prompt, params).token_ids) == first[0]
        )  # counts restart per weight version
    finally:
        generator.close()
    assert seeded[0] == seeded[1]  # vLLM's per-request seed fixes the stream


def test_stop_token_ids_stop_strings_and_budget(tiny_model_dir):
    generator = HFGenerator(str(tiny_model_dir), max_new_tokens=16, seed=0)
    tok = generator.tokenizer
    known = {"temperature": 1.0, "seed": 11}  # a fixed stream: every run samples the same path
    try:
        prompt = _prompts(6, 1, 30, 31)[0]
        free = generator.generate(prompt, known).token_ids
        assert len(free) == 16
        k = next(i for i in range(3, 16) if free[i] not in free[:i])
        out = generator.generate(prompt, {**known, "stop_token_ids": [free[k]]}).token_ids
        assert out == free[: k + 1]  # the stop token is the last output token

        text = tok.decode(free, skip_special_tokens=True)
        stop = text[len(text) // 2 : len(text) // 2 + 3]  # usually spans a token boundary
        j = next(i for i in range(16) if stop in tok.decode(free[: i + 1], skip_special_tokens=True))
        params = {**known, "stop": [stop, "never-generated-#"], "include_stop_str_in_output": True}
        out = generator.generate(prompt, params).token_ids
        assert out == free[: j + 1] and stop in tok.decode(out)
        assert generator.generate(prompt, {**known, "max_tokens": 3}).token_ids == free[:3]
    finally:
        generator.close()


def test_cancelled_and_closed_requests(tiny_model_dir):
    generator = HFGenerator(str(tiny_model_dir), max_new_tokens=64, seed=0)
    prompt = _prompts(7, 1, 10, 11)[0]
    doomed = generator.submit(prompt, {"max_tokens": 64})
    doomed.cancel()
    out = generator.generate(prompt, {"max_tokens": 2})
    assert len(out.token_ids) == 2
    generator.close()
    with pytest.raises(RuntimeError, match="closed"):
        generator.submit(prompt, {})


def test_idle_engine_thread_exits_and_restarts(tiny_model_dir, monkeypatch):
    import cpu_engine.hf_generate as hf_generate

    monkeypatch.setattr(hf_generate, "IDLE_EXIT_S", 0.05)
    generator = HFGenerator(str(tiny_model_dir), max_new_tokens=2, seed=0)
    prompt = _prompts(9, 1, 5, 6)[0]
    first = generator.generate(prompt, {"max_tokens": 2}).token_ids
    thread = generator._thread
    thread.join(timeout=60)
    assert not thread.is_alive() and generator._thread is None  # nothing holds the generator now
    again = (
        HFGenerator(str(tiny_model_dir), max_new_tokens=2, seed=0)
        .generate(prompt, {"max_tokens": 2})
        .token_ids
    )
    assert generator.generate(prompt, {"max_tokens": 2}).token_ids != [] and first == again
    generator.close()


def test_an_engine_error_fails_its_requests_and_the_engine_keeps_serving(tiny_model_dir, monkeypatch):
    generator = HFGenerator(str(tiny_model_dir), max_new_tokens=4, seed=0)
    prompt = _prompts(8, 1, 10, 11)[0]
    try:

        def broken(*args, **kwargs):
            raise RuntimeError("merge broke")

        with monkeypatch.context() as patch:
            patch.setattr(CacheRows, "merge", staticmethod(broken))
            with pytest.raises(RuntimeError, match="merge broke"):
                generator.generate(prompt, {"max_tokens": 4})
        assert len(generator.generate(prompt, {"max_tokens": 4}).token_ids) == 4
    finally:
        generator.close()


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"beam_width": 4}, "beam_width"),
    ],
)
def test_bad_sampling_params_name_the_field(params, match):
    with pytest.raises(ValueError, match=match):
        SamplingSpec.from_params(params, 16, [2])


def test_sampling_spec_reads_verl_and_vllm_keys():
    spec = SamplingSpec.from_params(
        {"temperature": 0.5, "top_k": -1, "stop_token_ids": [7], "stop": "</answer>", "logprobs": True},
        16,
        [2],
    )
    assert (spec.max_tokens, spec.top_k, spec.stop) == (16, 0, ("</answer>",))
    assert spec.stop_token_ids == {2, 7} and spec.stop_window == len("</answer>") + 1
    spec = SamplingSpec.from_params({"max_new_tokens": 3, "ignore_eos": True, "stop_token_ids": [7]}, 16, [2])
    assert (spec.max_tokens, spec.stop_token_ids, spec.temperature) == (3, {7}, 1.0)


def test_sample_rows_filters_per_row():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    specs = [
        SamplingSpec(max_tokens=1, temperature=0.0),
        SamplingSpec(max_tokens=1, temperature=1.0, top_k=1),
        SamplingSpec(max_tokens=1, temperature=1.0, top_p=1e-6),
        SamplingSpec(max_tokens=1, temperature=2.0, top_k=3),
    ]
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    greedy_state = generators[0].get_state()
    top3 = set(torch.topk(logits[3], 3).indices.tolist())
    for _ in range(200):
        tokens, log_probs = sample_rows(logits, specs, generators)
        best = int(logits[0].argmax())
        assert (
            tokens[0] == best
            and tokens[1] == int(logits[1].argmax())
            and tokens[2] == int(logits[2].argmax())
        )
        assert tokens[3] in top3
        assert log_probs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[best]))
    assert torch.equal(generators[0].get_state(), greedy_state)  # greedy rows draw nothing


@pytest.mark.slow
def test_sample_rows_draws_from_the_tempered_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    generator = torch.Generator().manual_seed(0)
    for spec, allowed in [
        (SamplingSpec(max_tokens=1, temperature=0.5), 5),
        (SamplingSpec(max_tokens=1, temperature=1.0, top_k=3), 3),
        (
            SamplingSpec(max_tokens=1, temperature=1.0, top_p=0.8),
            3,
        ),  # mass before the 3rd token is 0.77 < 0.8
    ]:
        draws = [sample_rows(logits, [spec], [generator])[0][0] for _ in range(4000)]
        expected = torch.softmax(logits[0, :allowed] / spec.temperature, dim=-1)
        counts = torch.bincount(torch.tensor(draws), minlength=5).float() / len(draws)
        assert counts[allowed:].sum() == 0
        assert torch.allclose(counts[:allowed], expected, atol=0.03)


def _rows(length: int, value: float) -> CacheRows:
    kv = torch.full((1, 2, length, 3), value)
    conv, rec = torch.full((1, 5, 4), value), torch.full((1, 2, 3, 3), value)
    return CacheRows((LINEAR, FULL), ((conv, rec), (kv, kv + 1)), torch.ones(1, length, dtype=torch.long))


def _same_rows(got: CacheRows, want: CacheRows) -> bool:
    """Same rows, widths and tensors (exactly)."""
    if (got.batch_size, got.width) != (want.batch_size, want.width):
        return False
    return all(
        torch.equal(x, y)
        for i in range(len(got.kinds))
        for x, y in zip(got._used(i), want._used(i), strict=True)
    )


def test_cache_rows_merge_drop_row_round_trip():
    short, long, mid = _rows(2, 1.0), _rows(4, 2.0), _rows(3, 3.0)
    merged = CacheRows.merge([short, long])
    assert merged.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]] and merged.lengths() == [2, 4]
    keys = merged.layers[1][0]
    assert keys.shape == (2, 2, 4 + SPARE_COLUMNS, 3)  # free columns for in-place appends
    assert float(keys[0, :, :2].abs().sum()) == 0.0  # pad columns are zeros
    assert _same_rows(merged.row(1), long) and _same_rows(merged.row(0), short)
    alone, order = merged.drop([1])
    assert order == [0] and alone.width == 2  # padding shared by no remaining row is dropped
    same_buffer = alone.layers[1][0].untyped_storage().data_ptr() == keys.untyped_storage().data_ptr()
    assert _same_rows(alone, short) and same_buffer  # in place, no new buffer
    three = CacheRows.merge([short, long, mid])
    rest, order = three.drop([0])
    assert order == [2, 1] and rest.lengths() == [3, 4]  # the last row fills the hole
    assert _same_rows(rest.row(0), mid) and _same_rows(rest.row(1), long)
    with pytest.raises(ValueError, match="at least one row"):
        rest.drop([0, 1])


def test_cache_rows_extend_writes_joining_rows_into_free_rows():
    short, long, mid = _rows(2, 1.0), _rows(4, 2.0), _rows(3, 3.0)
    batch = CacheRows.merge([long], spare_rows=2)
    keys = batch.layers[1][0]
    assert keys.shape[0] == 3 and batch.batch_size == 1
    grown = batch.extend([short, mid])
    assert grown is not None and grown.layers[1][0] is keys  # in place: no new buffer
    assert grown.mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]]
    assert float(keys[1, :, :2].abs().sum()) == 0.0  # pad columns are zeros
    for index, want in enumerate((long, short, mid)):
        assert _same_rows(grown.row(index), want)
    assert grown.extend([short]) is None  # no free row left
    assert CacheRows.merge([mid], spare_rows=1).extend([long]) is None  # wider than the batch


def test_append_layer_writes_in_place_only_past_the_used_columns():
    rows = CacheRows.merge([_rows(3, 1.0)])
    snapshot = rows.row(0)  # a cached copy
    buffer = rows.layers[1][0]
    layer = AppendLayer(*rows.layers[1], rows.width, rows.batch_size)
    keys, _ = layer.update(torch.full((1, 2, 1, 3), 7.0), torch.full((1, 2, 1, 3), 8.0))
    assert keys.shape[-2] == 4 and keys.data_ptr() == buffer.data_ptr()  # no copy
    assert torch.equal(keys[:, :, :3], snapshot.layers[1][0]) and float(keys[0, 0, 3, 0]) == 7.0
    full = AppendLayer(*snapshot.layers[1], snapshot.width, 1)  # no free column: must reallocate
    grown, _ = full.update(torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 3))
    assert grown.data_ptr() != snapshot.layers[1][0].data_ptr() and torch.equal(
        snapshot.layers[1][0], buffer[:, :, :3]
    )


def test_prefix_cache_longest_prefix_and_byte_bound():
    def snap(tokens: tuple[int, ...]) -> Snapshot:
        return Snapshot(tokens, _rows(len(tokens), 0.0), torch.zeros(8))

    stored = [snap(tokens) for tokens in [(1, 2), (1, 2, 3, 4), (9, 9)]]
    cache = PrefixCache(max_bytes=sum(s.nbytes() for s in stored))
    for snapshot in stored:
        cache.put(snapshot)
    assert len(cache) == 3
    assert cache.longest_prefix((1, 2, 3, 4, 5)).tokens == (1, 2, 3, 4)
    assert cache.longest_prefix((1, 2, 3)).tokens == (1, 2)
    assert cache.longest_prefix((1, 2)).tokens == (1, 2)  # exact: its stored logits are used
    assert cache.longest_prefix((2, 1)) is None
    cache.put(snap((5, 5, 5, 5, 5, 5)))  # over the bound: the least recently used goes first
    assert cache.nbytes <= cache.max_bytes and cache.longest_prefix((9, 9, 1)) is None
    off = PrefixCache(0)
    off.put(snap((1,)))
    assert len(off) == 0


@pytest.mark.slow
def test_local_rollout_agent_loops_share_decoding_steps(make_local_rollout):
    """verl's AgentLoopWorker runs a batch's trajectories as concurrent coroutines; through
    ``HFLLMClient`` their turns reach the generator together and are decoded together (the path
    of the evaluation harness's ``hf`` backend)."""
    from search_env import protocol
    from search_env.verl_glue import rollout_records

    rollout = make_local_rollout(max_turn_tokens=8, max_assistant_turns=2)
    generator = rollout.client.generator
    rows = [
        {
            "prompt": protocol.build_messages(question),
            "data_source": "test",
            "agent_name": "search_agent",
            "extra_info": {"index": i, "tools_kwargs": {}},
        }
        for i, question in enumerate(["who was evan morris", "where is genentech"])
    ]
    before = generator.stats()
    batch = rollout.generate(rows, n=3)
    after = generator.stats()
    assert len(rollout_records(batch, rollout.tokenizer)) == 6
    steps = after["decode_steps"] - before["decode_steps"]
    assert after["decoded_rows"] - before["decoded_rows"] >= 3 * steps
    assert after["prefix_hits"] > before["prefix_hits"]  # the 3 rollouts of a question share its prompt


def test_decode_attention_equals_sdpa_with_padding_and_strided_keys():
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from cpu_engine.decode_attention import decode_attention

    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    query = torch.randn(3, 4, 1, 8)
    buffers = torch.randn(2, 3, 2, 10 + SPARE_COLUMNS, 8)  # keys/values with free columns
    key, value = buffers[0, :, :, :10], buffers[1, :, :, :10]
    mask = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., :4] = False  # left padding
    mask[2, ..., :9] = False
    for attention_mask in (mask, None):
        got, _ = decode_attention(module, query, key, value, attention_mask, scaling=0.3)
        want, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=0.3)
        assert got.shape == want.shape == (3, 1, 4, 8)
        assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("length", [1, 5, 64, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_delta_rule_equals_the_transformers_fallback(length, with_state):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from cpu_engine.delta_rule import chunk_gated_delta_rule

    torch.manual_seed(length)
    query, key, value = (torch.randn(2, length, 4, 16) for _ in range(3))
    g, beta = -2 * torch.rand(2, length, 4), torch.rand(2, length, 4)
    state = torch.randn(2, 4, 16, 16) if with_state else None
    kwargs = {"initial_state": state, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    want = torch_chunk_gated_delta_rule(query, key, value, g, beta, **kwargs)
    got = chunk_gated_delta_rule(query, key, value, g, beta, **kwargs)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)


def test_generator_model_scores_like_the_stock_transformers_model(model_dir):
    """The generator's attention and delta-rule replacements leave the model's numbers as they were."""
    from transformers import AutoModelForCausalLM

    from cpu_engine.delta_rule import chunk_gated_delta_rule

    generator = HFGenerator(model_dir, max_new_tokens=4, seed=0)
    assert any(
        getattr(m, "chunk_gated_delta_rule", None) is chunk_gated_delta_rule
        for m in generator.model.modules()
    )
    stock = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt, tokens = _prompts(10, 1, 150, 151)[0], _prompts(11, 1, 20, 21)[0]
    out = generator.generate(prompt, {"temperature": 0.0, "max_tokens": 4})
    with torch.inference_mode():
        logits = stock(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        first = torch.log_softmax(stock(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert torch.allclose(torch.tensor(generator.score(prompt, tokens)), want, atol=1e-5)
    assert out.token_ids[0] == int(first.argmax()) and out.log_probs[0] == pytest.approx(
        float(first.max()), abs=1e-5
    )
    generator.close()
