"""The GPU smoke test's checks, one subcommand each (``python -m launch.doctor.gpu_smoke NAME``):
the CUDA gate and the installed versions, the tiny model, the dense retriever and the faiss GPU
index, packed sequences and the memory of the real shape, the rollout log-probs and checkpoints of
the grpo stage, and the LLM judge. Each prints ``| item | value |`` rows, then ``RESULT: ...``, and
returns 0 when its check passes (what each checks: docs/gpu.md)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from launch.doctor.cuda import driver_version, no_cuda_reason
from launch.serve_judge import wait_ready
from search_env import protocol
from search_env.checkpoint_layout import TRACKER, step_dir_name, step_of
from search_env.paths import REPO_ROOT
from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.process import free_port, spawn_server

TINY_MODEL = "tiny_qwen35_v248k"
"""The tiny stage's model, under SMOKE_DIR."""
DENSE_INDEX = "demo_IVF16_SQ8.index"
"""The dense stage's index, under SMOKE_DIR (its encoder: SMOKE_DIR/encoder); grpo and eval search it."""
REAL_VOCAB = 248_320
QWEN35_08B_TEXT = {
    "vocab_size": REAL_VOCAB,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": True,
}
"""Qwen3.5-0.8B's text model (model card; 752 M parameters) when no local config is given."""
NQ_SAMPLE = REPO_ROOT / "assets" / "eval_samples" / "flashrag-quickstart" / "nq_test.jsonl"
"""The NQ questions the tiny stage turns into the grpo stage's train and val parquet."""


def row(item: str, value: object) -> None:
    print(f"| {item} | {value} |")


def result(ok: bool, text: str) -> int:
    print(f"RESULT: {'PASS' if ok else 'FAIL'}: {text}")
    return 0 if ok else 1


def cmd_cuda(_: argparse.Namespace) -> int:
    import torch  # heavy: this stage only

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return 0
    print(f"no CUDA device: {no_cuda_reason()}", file=sys.stderr)
    return 2


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "MISSING"


def cmd_versions(_: argparse.Namespace) -> int:
    import torch  # heavy: this stage only

    row("driver", driver_version() or "unknown")
    row("torch", f"{torch.__version__} (CUDA {torch.version.cuda})")
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        row(
            f"cuda:{i}",
            f"{props.name}, compute {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB",
        )
    dists = {
        "vllm": "vllm",
        "flash-attn": "flash-attn",
        "fla": "flash-linear-attention",
        "transformers": "transformers",
        "verl": "verl",
        "faiss-gpu": "faiss-gpu",
    }
    found = {name: _version(dist) for name, dist in dists.items()}
    for name, version in found.items():
        row(name, version)
    second_faiss = _version("faiss-cpu")  # the CPU set's faiss: beside faiss-gpu, one of them wins
    if second_faiss != "MISSING":
        row(
            "faiss-cpu",
            f"{second_faiss} ALSO INSTALLED: pip uninstall -y faiss-cpu faiss-gpu && pip install -e '.[gpu]'",
        )
    try:
        import faiss  # optional: faiss-gpu may be missing (reported)

        from search_env.retrieval.placement import gpu_unavailable_reason  # heavy: faiss, only this stage

        row("faiss GPUs", f"{faiss.get_num_gpus()} ({gpu_unavailable_reason() or 'faiss can use them'})")
    except ImportError as err:
        row("faiss import", f"FAILED: {err}")
    missing = [n for n in dists if found[n] == "MISSING"]
    ok = torch.version.cuda is not None and not missing and second_faiss == "MISSING"
    beside = "; faiss-cpu beside faiss-gpu" if second_faiss != "MISSING" else ""
    return result(ok, f"missing: {missing or 'none'}{beside}")


def cmd_tiny(args: argparse.Namespace) -> int:
    """A tiny random ``qwen3_5`` (search_demo.tiny's shape) whose vocabulary is the real 248,320,
    and, with ``--data DIR``, DIR/{train,val}.parquet from the NQ sample questions (:data:`NQ_SAMPLE`)."""
    import torch  # heavy: this stage only
    from transformers import GenerationConfig  # heavy: this stage only
    from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration  # heavy: this stage only

    from search_demo import tiny  # heavy: torch, only this stage

    out = Path(args.out)
    tokenizer = tiny.build_tokenizer(0)
    config = tiny.build_config(tokenizer, tiny.TEXT_CONFIG)
    config.text_config.vocab_size = REAL_VOCAB  # ids beyond the tokenizer's are never produced by it
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config)
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, do_sample=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    row("tiny model", f"{out} ({n / 1e6:.1f} M parameters, vocab {REAL_VOCAB})")
    if args.data:
        questions = NQ_SAMPLE
        for split, name in (("train", "train"), ("test", "val")):
            target = Path(args.data) / f"{name}.parquet"
            convert = [sys.executable, "-m", "search_env.data", "convert", "--input", str(questions)]
            convert += ["--data-source", "nq", "--split", split, "--out", str(target)]
            subprocess.run(convert, check=True, capture_output=True, timeout=120)
            row(f"{name} parquet", target)
    return result(True, "built")


def cmd_dense(args: argparse.Namespace) -> int:
    """The E5 code path (a tiny 128-d BERT) on the GPU, IVF-SQ8 built with GPU faiss (`--gpu auto`)
    and served from CPU faiss (`--gpu auto`, the training placement): build-index, serve, /health,
    a 512-query /retrieve."""
    from search_env.retrieval.encoder import build_tiny_encoder  # heavy: torch, only this stage

    work = Path(args.work)
    encoder = build_tiny_encoder(work / "encoder", hidden_size=128)
    index = work / DENSE_INDEX
    build = [sys.executable, "-m", "search_env.retrieval", "build-index", "--corpus", str(SAMPLE_CORPUS)]
    build += ["--encoder", str(encoder), "--out", str(index), "--factory", "IVF16,SQ8", "--gpu", "auto"]
    subprocess.run(build, check=True, capture_output=True, timeout=120)
    serve = ["--backend", "dense", "--corpus", str(SAMPLE_CORPUS), "--index", str(index)]
    serve += ["--encoder", str(encoder), "--nprobe", "4", "--gpu", "auto"]
    server = spawn_server(serve, log_path=work / "server.log")
    try:
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        row("encoder device", health.get("encoder_device"))
        row("index on GPU", health.get("index_on_gpu"))
        queries = [f"who founded the city number {i}" for i in range(512)]
        start = time.perf_counter()
        answer = httpx.post(
            f"{server.url}/retrieve", json={"queries": queries, "topk": protocol.TOPK}, timeout=120
        )
        seconds = time.perf_counter() - start
        hits = answer.json()["result"] if answer.status_code == 200 else []
        row(
            "512-query request",
            f"HTTP {answer.status_code}, {len(queries) / seconds:.0f} q/s (1,000-row demo index)",
        )
    finally:
        server.stop()
    ok = str(health.get("encoder_device", "")).startswith("cuda") and len(hits) == 512 and all(hits)
    ok = ok and health.get("index_on_gpu") is False
    return result(ok, "E5 path on cuda, IVF-SQ8 on CPU faiss, every query answered" if ok else "see rows")


GPU_INDEX_SHAPE = {"n": 100_000, "dim": 768, "factory": "IVF1024,SQ8", "nprobe": 16, "queries": 2000, "k": 10}
"""The gpu-index stage's index: E5's dimension, nprobe 16 of 1024 lists (the 1.6 % of lists that
nprobe 64 scans of wiki-18's IVF4096), a batch of 2,000 queries."""
WIKI18_SQ8_BYTES = 21_015_324 * (768 + 8)
"""The wiki-18 IVF4096,SQ8 index: one 768-byte code and one 64-bit id per passage (16.3 GB)."""


def compare_searches(cpu: tuple, gpu: tuple) -> dict[str, float]:
    """How a GPU search result matches the CPU one, both ``(scores, ids)`` arrays of shape
    (queries, k): ``overlap`` = mean fraction of each CPU top-k found in the GPU top-k,
    ``top1`` = fraction of queries with the same first id, ``score_diff`` = largest absolute
    difference of the first scores where the first ids agree (0.0 when none agree)."""
    from search_env.retrieval.recall import recall_at_k  # heavy: faiss, only the gpu-index stage

    same = cpu[1][:, 0] == gpu[1][:, 0]
    diff = np.abs(cpu[0][same, 0] - gpu[0][same, 0])
    return {
        "overlap": recall_at_k(gpu[1], cpu[1]),
        "top1": float(same.mean()),
        "score_diff": float(diff.max()) if diff.size else 0.0,
    }


def _timed_search(index, queries, k: int) -> tuple[tuple, float]:
    """((scores, ids), milliseconds per query) of one batched search, after a 100-query warm-up."""
    index.search(queries[:100], k)
    start = time.perf_counter()
    found = index.search(queries, k)
    return found, (time.perf_counter() - start) * 1000 / len(queries)


def cmd_gpu_index(args: argparse.Namespace) -> int:
    """A real faiss index placed on the GPU as `serve --gpu on` (evaluation) places it: IVF1024,SQ8
    over 100,000 clustered 768-d unit vectors, built on CPU and written to WORK, loaded twice with
    `load_index` (CPU, and ``use_gpu=True``), 2,000 queries searched on both. Passes when the index
    is on the GPU, its top-10 holds >= 99 % of the CPU's and the top-1 scores agree within 1e-3.
    Reports the copy time, ms per query on each, and where wiki-18's 16.3 GB index would go with the
    GPUs' free memory now. Exit 2 without a CUDA device."""
    import faiss  # heavy: this stage only
    import torch  # heavy: this stage only

    from search_env.retrieval import index_build, placement  # heavy: faiss, only this stage
    from search_env.retrieval.index import load_index  # heavy: faiss, only this stage

    if not torch.cuda.is_available():
        print("no CUDA device: the GPU-index stage needs one (skipped)", file=sys.stderr)
        return 2
    reason = placement.gpu_unavailable_reason()
    if reason:
        return result(False, f"faiss cannot use the GPU: {reason}")
    shape = GPU_INDEX_SHAPE
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(1000, shape["dim"])).astype(np.float32)
    x = centres[rng.integers(0, len(centres), size=shape["n"])]
    x += 0.35 * rng.normal(size=x.shape).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    built, factory = index_build.train_and_fill(
        shape["factory"], shape["dim"], shape["n"], lambda rows: x[rows], 40 * 1024, 50_000, 0, False, "build"
    )
    path = Path(args.work) / "gpu_smoke_IVF1024_SQ8.index"
    index_build.write_index(built, path, {"factory": factory, "source": "gpu_smoke gpu-index"})
    queries = x[rng.choice(shape["n"], size=shape["queries"], replace=False)] + 0.01
    cpu = load_index(path, nprobe=shape["nprobe"])
    gpu = load_index(path, nprobe=shape["nprobe"], use_gpu=True)
    row("index", f"{factory}, {shape['n']:,} x {shape['dim']} ({path.stat().st_size / 1e6:.0f} MB file)")
    row("placement", gpu.placement)
    if not gpu.on_gpu:
        return result(False, f"the index stayed on CPU: {gpu.placement}")
    row("copy to GPU (load_index)", f"{gpu.load_s:.2f} s")
    cpu_found, cpu_ms = _timed_search(cpu.index, queries, shape["k"])
    gpu_found, gpu_ms = _timed_search(gpu.index, queries, shape["k"])
    batch = f"{shape['queries']:,} queries batched, nprobe {shape['nprobe']}, k {shape['k']}"
    row("CPU search", f"{cpu_ms:.3f} ms/query ({batch}, {faiss.omp_get_max_threads()} threads)")
    row("GPU search", f"{gpu_ms:.4f} ms/query ({batch})")
    match = compare_searches(cpu_found, gpu_found)
    row("GPU top-10 holding the CPU top-10", f"{match['overlap']:.4f}")
    row("same top-1", f"{match['top1']:.4f}; largest top-1 score difference {match['score_diff']:.2e}")
    free = placement.gpu_free_bytes()
    wiki = placement.choose_gpus(WIKI18_SQ8_BYTES, free)
    one_gpu = placement.gpu_bytes_needed(WIKI18_SQ8_BYTES, 1) / 2**30
    where = f"GPU {','.join(map(str, wiki))}" if wiki else f"CPU (needs {one_gpu:.1f} GiB on one GPU)"
    row("wiki-18 IVF4096,SQ8 (16.3 GB) with this free memory", where)
    ok = match["overlap"] >= 0.99 and match["score_diff"] < 1e-3
    speedup = cpu_ms / max(gpu_ms, 1e-9)
    return result(ok, f"GPU index = CPU index ({match['overlap']:.4f} of top-10), {speedup:.0f}x faster")


def _packed_inputs(lengths: list[int], vocab: int, seed: int = 0):
    """Random sequences of ``lengths``; their packed (1, total) form with restarting positions."""
    import torch  # heavy: torch, only the packed stage

    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(10, vocab, (n,), generator=gen) for n in lengths]
    packed = torch.cat(seqs).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)
    return seqs, packed, positions, cu


def _token_logprobs(logits, ids):
    import torch  # heavy: torch, only the packed stage

    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp[:-1].gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)


def cmd_packed(args: argparse.Namespace) -> int:
    """verl's remove-padding path (packed sequences + cu_seqlens through verl's Qwen3.5 monkey patch:
    fla's Gated-DeltaNet kernels, flash-attn varlen) against each sequence alone, on the tiny
    248K-vocab model. GPU: bf16 + flash_attention_2; ``--cpu`` (tests): fp32 + sdpa, torch fallbacks."""
    import torch  # heavy: this stage only
    from transformers import AutoModelForImageTextToText  # heavy: this stage only
    from verl.models.transformers.monkey_patch import apply_monkey_patch  # heavy: this stage only

    device, dtype, attn = (
        ("cpu", torch.float32, "sdpa") if args.cpu else ("cuda", torch.bfloat16, "flash_attention_2")
    )
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=dtype, attn_implementation=attn).to(
        device
    )
    model.eval()
    model.config.use_cache = model.config.text_config.use_cache = False  # as verl's actor: no KV cache
    apply_monkey_patch(model, use_remove_padding=True)
    lengths = [37, 300, 1000, 129] if not args.cpu else [7, 30, 19]
    seqs, packed, positions, cu = _packed_inputs(lengths, model.config.text_config.vocab_size)
    worst = 0.0
    with torch.no_grad():
        out = model(
            input_ids=packed.to(device),
            position_ids=positions.to(device),
            cu_seqlens=cu.to(device),
            cu_seqlens_cpu=cu,
        )
        logits = out.logits[0]
        for seq, start, end in zip(seqs, cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            alone = model(
                input_ids=seq.unsqueeze(0).to(device),
                position_ids=torch.arange(len(seq)).unsqueeze(0).to(device),
            )
            a = _token_logprobs(alone.logits[0], seq.to(device))
            p = _token_logprobs(logits[start:end], seq.to(device))
            worst = max(worst, float((a - p).abs().max()))
    tolerance = 1e-3 if args.cpu else 0.05
    row("sequences", f"{lengths} (packed into 1 x {sum(lengths)})")
    row("max /log-prob packed - alone/", f"{worst:.2e}")
    return result(math.isfinite(worst) and worst < tolerance, f"packed == one by one (tolerance {tolerance})")


def cmd_rollout_logprobs(args: argparse.Namespace) -> int:
    """verl's own comparison of the vLLM rollout log-probs with the FSDP old-log-prob recompute."""
    rows = [json.loads(line) for line in Path(args.metrics).read_text().splitlines() if line.strip()]
    keys = (
        "training/rollout_probs_diff_valid",
        "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_mean",
        "training/rollout_actor_probs_pearson_corr",
    )
    ok = bool(rows)
    for r in rows:
        data = r.get("data", r)
        for key in keys:
            row(f"step {r.get('step')} {key.split('/')[-1]}", data.get(key, "absent"))
        ok = ok and data.get(keys[0]) == 1 and float(data.get(keys[2], math.inf)) < 0.02
    return result(ok, "vLLM and FSDP agree (mean |p_rollout - p_fsdp| < 0.02 every step)")


def cmd_checkpoints(args: argparse.Namespace) -> int:
    """Older checkpoints pruned to weights, the latest complete (search_env.checkpoint_policy)."""
    from search_env.checkpoint_policy import has_hf_weights  # heavy: verl/torch, only this stage

    root = Path(args.ckpt_dir)
    latest = int((root / TRACKER).read_text())
    steps = sorted(step for p in root.glob(step_dir_name("*")) if (step := step_of(p.name)) is not None)
    ok = bool(steps)
    for step in steps:
        actor = root / step_dir_name(step) / "actor"
        optim = sorted(actor.glob("optim_*.pt"))
        shards = sorted(actor.glob("model_world_size_*.pt"))
        weights = has_hf_weights(actor / "huggingface")
        row(step_dir_name(step), f"hf weights {weights}, shards {len(shards)}, optimizer {len(optim)}")
        ok = ok and weights and (bool(optim) == (step == latest)) and (bool(shards) == (step == latest))
    return result(ok, f"only {step_dir_name(latest)} keeps optimizer + shards; every step has HF weights")


def cmd_memory(args: argparse.Namespace) -> int:
    """Peak CUDA memory of one forward+backward at 16,384 and 32,768 tokens, real 0.8B shape.

    As a training micro-batch computes it: bf16 weights (FSDP's compute copy; the fp32 master
    weights, 3.0 GB, and Adam's moments, 6.0 GB, come on top in training), gradient checkpointing,
    flash-attention, and log-probs of every token over the 248,320-token vocabulary with verl's own
    ``logprobs_from_logits`` on the rolled labels (no copy of the logits).
    """
    import torch  # heavy: this stage only
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5TextConfig  # heavy: this stage only
    from verl.utils.torch_functional import logprobs_from_logits  # heavy: this stage only

    if args.model_dir and (Path(args.model_dir) / "config.json").is_file():
        text = AutoConfig.from_pretrained(args.model_dir).get_text_config()
    else:
        text = Qwen3_5TextConfig(**QWEN35_08B_TEXT)
    model = AutoModelForCausalLM.from_config(
        text, attn_implementation="flash_attention_2", dtype=torch.bfloat16
    )
    model = model.cuda()
    model.gradient_checkpointing_enable()
    model.train()
    row(
        "model",
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, vocab {text.vocab_size}",
    )
    ok = True
    seq = 8192
    for tokens in (16_384, 32_768):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(10, text.vocab_size, (tokens // seq, seq), device="cuda")
        try:
            logits = model(input_ids=ids, use_cache=False).logits
            logp = logprobs_from_logits(logits, torch.roll(ids, shifts=-1, dims=1))
            logp.mean().backward()
            peak = f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        except torch.OutOfMemoryError:
            peak = "OUT OF MEMORY"
            ok = ok and tokens > 16_384  # the recipe trains at 16,384; 32,768 is measured, not required
        finally:
            logits = logp = None
            model.zero_grad(set_to_none=True)
        row(f"{tokens:,} tokens ({tokens // seq} x {seq}) forward+backward peak", peak)
    row("device memory", f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
    return result(ok, "a 16,384-token micro-batch (the recipe's actor budget) fits")


JUDGE_CASES: tuple[tuple[str, list[str], str, str], ...] = (
    ("Who was the 35th president of the United States?", ["John F. Kennedy"], "JFK", "correct"),
    ("What is the capital of Australia?", ["Canberra"], "Sydney", "incorrect"),
    ("In which year did World War II end?", ["1945"], "It ended in 1945.", "correct"),
    ("Who wrote Pride and Prejudice?", ["Jane Austen"], "Charlotte Bronte", "incorrect"),
    ("What is the largest planet in the Solar System?", ["Jupiter"], "the planet Jupiter", "correct"),
    ("Which element has the chemical symbol Fe?", ["iron"], "gold", "incorrect"),
    ("Who painted the Mona Lisa?", ["Leonardo da Vinci"], "Leonardo", "correct"),
    ("How many continents are there?", ["seven", "7"], "five", "incorrect"),
)
"""(question, golds, prediction, the right judgement): the judge stage's cases, half of each."""
JUDGE_STARTUP_S = 240


def cmd_judge(args: argparse.Namespace) -> int:
    """A real judge on a real model: ``launch/serve_judge.sh MODEL_DIR`` (vLLM on the GPU, 30 % of its
    memory) on a free port, :data:`JUDGE_CASES` judged through reward_fns.judge (batched, T = 0) into a
    verdict store under WORK, then judged again. Passes when every call is answered, at least half of
    the verdicts parse and the rerun asks only the unparsed ones again; reports agreement with the right judgements and
    verdicts per second. Exit 2 without a CUDA device; the server is stopped by its PID."""
    import torch  # heavy: this stage only

    from reward_fns.judge import JudgeConfig, JudgeError, VerdictCache, judge_many  # this stage only

    if not torch.cuda.is_available():
        print("no CUDA device: the judge stage needs one (skipped)", file=sys.stderr)
        return 2
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        return result(False, f"no model at {model_dir} (launch/prepare.sh fetches Qwen3.5-0.8B)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "PORT": str(port), "JUDGE_MODEL": "smoke-judge", "GPU_MEMORY_UTILIZATION": "0.3"}
    with open(work / "serve_judge.log", "w") as log:
        server = subprocess.Popen(
            ["bash", str(REPO_ROOT / "launch" / "serve_judge.sh"), str(model_dir)],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            took = wait_ready(url, server, JUDGE_STARTUP_S)
        except (RuntimeError, TimeoutError) as err:
            return result(False, f"{err} (log: {work / 'serve_judge.log'})")
        row("server start", f"{took:.0f} s")
        cfg = JudgeConfig(url=f"{url}/v1", model="smoke-judge", timeout_s=120.0)
        store = VerdictCache(work / "verdicts.jsonl")
        items = [(q, golds, pred) for q, golds, pred, _ in JUDGE_CASES]
        try:
            t1 = time.monotonic()
            verdicts, calls = judge_many(cfg, items, store)
            seconds = time.monotonic() - t1
            _, rerun_calls = judge_many(cfg, items, store)
        except JudgeError as err:
            return result(False, f"the judge failed: {err}")
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)
    parsed = sum(v.judgement != "unparsed" for v in verdicts)
    right = sum(v.judgement == case[3] for v, case in zip(verdicts, JUDGE_CASES, strict=True))
    row("verdicts", f"{calls} calls in {seconds:.1f} s ({calls / seconds:.1f} verdicts/s)")
    row("parsed", f"{parsed} of {len(items)}")
    row("agree with the right judgement", f"{right} of {len(items)}")
    row("rerun calls", rerun_calls)
    unparsed = {
        (q, tuple(g), p) for (q, g, p), v in zip(items, verdicts, strict=True) if v.judgement == "unparsed"
    }
    ok = parsed * 2 >= len(items) and rerun_calls == len(unparsed)
    return result(ok, f"{parsed}/{len(items)} verdicts parsed, {right} right, rerun {rerun_calls} calls")
