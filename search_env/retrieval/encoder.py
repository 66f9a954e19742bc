"""Dense text encoder: HF AutoModel, masked mean pooling, L2 normalisation (so inner product = cosine).

Matches the E5 application of Search-R1 / FlashRAG: `"query: "` / `"passage: "` prefixes when the model
is E5 (its name or path contains "e5", or `e5=True`), passages encoded as the raw wiki-18 `contents`
(`"Title"\\ntext`), queries truncated to 256 tokens, fp16 weights on GPU, float32 output.

`build_tiny_encoder` writes a small random BERT with a WordPiece tokenizer trained locally on the demo
corpus: the same code path without downloading weights (tests, benchmarks, the CPU demo).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from tokenizers import normalizers, pre_tokenizers
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel, BertTokenizer

from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.corpus import Corpus

log = logging.getLogger(__name__)

CPU_PAD_SLACK = 1.25
"""On CPU a forward pass costs in proportion to its padded tokens, so texts are encoded in
length-sorted groups whose longest text is at most this many times their shortest (padding wastes
at most ~25% of the work). On GPU, where a pass costs about the same whatever its padding, a group is
only bounded by ``batch_size``."""

CHARS_PER_TOKEN_BOUND = 16
"""A text is cut to this many characters per token kept (`max_length`) before it is tokenised, so a
huge text costs no more than one that fills `max_length` (WordPiece/BPE tokens of natural text are a
few characters each; only a text whose first 16 x max_length characters hold fewer than max_length
tokens, e.g. runs of 100+ character words, can encode differently)."""

QUERY_PREFIX = "query: "
PASSAGE_PREFIX = "passage: "


def is_e5_model(model_path: str | os.PathLike[str]) -> bool:
    """Search-R1/FlashRAG rule: E5 prefixes iff "e5" occurs in the model name (case-insensitive)."""
    return "e5" in str(model_path).lower()


def resolve_device(use_gpu: bool | None) -> torch.device:
    """cuda when `use_gpu` is True, or None and CUDA is available; ValueError for True without CUDA."""
    if use_gpu and not torch.cuda.is_available():
        raise ValueError("--gpu on: no CUDA device is visible; use --gpu auto or --gpu off")
    return torch.device("cuda" if (use_gpu is None and torch.cuda.is_available()) or use_gpu else "cpu")


def length_groups(lengths: list[int], max_size: int, slack: float) -> list[list[int]]:
    """Indices of ``lengths`` in ascending-length groups of at most ``max_size``, each group's longest
    at most ``slack`` times its shortest (a longer one starts a new group). Every index appears once."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and len(groups[-1]) < max_size and lengths[i] <= slack * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of `hidden` (batch, tokens, dim) over tokens where `attention_mask` is 1, in float32."""
    mask = attention_mask.unsqueeze(-1).to(torch.float32)
    summed = (hidden.to(torch.float32) * mask).sum(dim=1)
    return summed / mask.sum(dim=1).clamp(min=1.0)


class Encoder:
    """Encode queries and passages into L2-normalised float32 vectors of size `dim`.

    model_path: HF model directory (or hub id when online). use_gpu: None = CUDA if available.
    fp16: None = fp16 on GPU, fp32 on CPU. batch_size: at most this many texts per forward pass (texts
    are grouped by length, see ``CPU_PAD_SLACK``). e5: force the E5 prefixes on/off (None = detect
    from the name). Not thread-safe: call from one thread at a time.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        use_gpu: bool | None = None,
        fp16: bool | None = None,
        batch_size: int = 256,
        query_max_length: int = 256,
        passage_max_length: int = 256,
        e5: bool | None = None,
    ) -> None:
        if batch_size < 1 or query_max_length < 1 or passage_max_length < 1:
            raise ValueError("Encoder: batch_size, query_max_length and passage_max_length must be >= 1")
        self.model_path = str(model_path)
        self.device = resolve_device(use_gpu)
        self.fp16 = self.device.type == "cuda" if fp16 is None else fp16
        self.is_e5 = is_e5_model(model_path) if e5 is None else e5
        self.batch_size = batch_size
        self.query_max_length = query_max_length
        self.passage_max_length = passage_max_length
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        dtype = torch.float16 if self.fp16 else torch.float32
        self.model = AutoModel.from_pretrained(self.model_path, dtype=dtype).to(self.device).eval()
        self.dim = int(self.model.config.hidden_size)
        log.info(
            "encoder %s on %s (%s, e5 prefixes %s, dim %d)",
            self.model_path,
            self.device,
            "fp16" if self.fp16 else "fp32",
            "on" if self.is_e5 else "off",
            self.dim,
        )

    def encode_queries(self, queries: Iterable[str]) -> np.ndarray:
        """(n, dim) float32 for questions/search queries (`query: ` prefix for E5)."""
        prefix = QUERY_PREFIX if self.is_e5 else ""
        return self.encode([prefix + q for q in queries], self.query_max_length)

    def encode_passages(self, contents: Iterable[str]) -> np.ndarray:
        """(n, dim) float32 for corpus `contents` (`passage: ` prefix for E5)."""
        prefix = PASSAGE_PREFIX if self.is_e5 else ""
        return self.encode([prefix + c for c in contents], self.passage_max_length)

    @torch.inference_mode()
    def encode(self, texts: list[str], max_length: int) -> np.ndarray:
        """Texts as given (no prefix) -> (n, dim) float32, C-contiguous, unit L2 norm, in input order.

        Each text is cut to ``CHARS_PER_TOKEN_BOUND`` x ``max_length`` characters, tokenised once,
        then encoded in length-sorted groups (``length_groups``) so short texts are not padded to the
        longest one; the result does not depend on the grouping.
        """
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        cut = CHARS_PER_TOKEN_BOUND * max_length
        tokens = self.tokenizer([text[:cut] for text in texts], truncation=True, max_length=max_length)
        slack = CPU_PAD_SLACK if self.device.type == "cpu" else float("inf")
        lengths = [len(ids) for ids in tokens["input_ids"]]
        for group in length_groups(lengths, self.batch_size, slack):
            features = {key: [values[i] for i in group] for key, values in tokens.items()}
            batch = self.tokenizer.pad(features, padding=True, return_tensors="pt").to(self.device)
            hidden = self.model(**batch).last_hidden_state
            pooled = torch.nn.functional.normalize(mean_pool(hidden, batch["attention_mask"]), dim=-1)
            out[group] = pooled.cpu().numpy()
        return out


def tiny_wordpiece_vocab(texts: Iterable[str], vocab_size: int) -> dict[str, int]:
    """A deterministic BERT WordPiece vocabulary: the 5 special tokens, every character seen (alone and
    as `##` continuation, so no word is [UNK]), then the most frequent lower-cased words (ties by
    spelling) up to `vocab_size` entries."""
    normalizer = normalizers.BertNormalizer(lowercase=True)
    splitter = pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(word for word, _ in splitter.pre_tokenize_str(normalizer.normalize_str(text)))
    chars = sorted({ch for word in counts for ch in word})
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{ch}" for ch in chars)]
    seen = set(tokens)
    for word, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(tokens) >= vocab_size:
            break
        if word not in seen:
            tokens.append(word)
            seen.add(word)
    return {token: i for i, token in enumerate(tokens)}


def build_tiny_encoder(
    out_dir: str | os.PathLike[str],
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    vocab_size: int = 2000,
    seed: int = 0,
    corpus: str | os.PathLike[str] = SAMPLE_CORPUS,
) -> Path:
    """Write a random-weight BERT (`hidden_size`-d output) and a WordPiece tokenizer whose vocabulary
    comes from `corpus` to `out_dir`; byte-identical for a given seed; no network. Returns `out_dir`."""
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} must be divisible by num_heads {num_heads}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = tiny_wordpiece_vocab(Corpus(corpus).iter_contents(), vocab_size)
    BertTokenizer(vocab=vocab, model_max_length=512).save_pretrained(out)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=512,
        pad_token_id=vocab["[PAD]"],
    )
    BertModel(config).save_pretrained(out)
    return out
