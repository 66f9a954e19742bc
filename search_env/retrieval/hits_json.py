"""A query's hits as JSON bytes, encoded once when searched (the query cache keeps them so), and the
answer bodies of the three endpoints joined from those bytes: no parse, no encode again. A body is
byte for byte what one `json.dumps` (", " and ": " separators, ensure_ascii=False) writes for the same
answer. Mechanism: docs/retrieval.md ("Query cache").
"""

from __future__ import annotations

import json
from array import array
from typing import NamedTuple

Hit = tuple[dict, float]
"""A corpus row (`{"id", "contents"}`) and its score."""
_DOC = b'{"document": '
_SCORE = b', "score": '


def _json(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8")


def _list(items: list[bytes]) -> bytes:
    """The JSON list of already-encoded `items`."""
    return b"[" + b", ".join(items) + b"]"


class EncodedHits(NamedTuple):
    """One query's hits as `[{"document": D, "score": S}, ...]` (`scored`) and, per hit, where D and
    S are in it (`cuts`: D's start and end, then S's, as native unsigned 64-bit integers)."""

    scored: bytes
    cuts: bytes

    def _pieces(self, first: int) -> list[bytes]:
        cuts = array("Q", self.cuts)
        return [
            self.scored[start:end] for start, end in zip(cuts[first::4], cuts[first + 1 :: 4], strict=True)
        ]

    def docs(self) -> bytes:
        """`[D, ...]`: the bare documents."""
        return _list(self._pieces(0))

    def scores(self) -> bytes:
        """`[S, ...]`: the scores."""
        return _list(self._pieces(2))


def encode_hits(hits: list[Hit]) -> EncodedHits:
    """`hits` as `EncodedHits` (each document and score encoded once)."""
    pieces, cuts, at = [], array("Q"), 1  # `at`: where the next piece starts, after "[" (and ", ")
    for doc, score in hits:
        d, s = _json(doc), _json(score)
        at += 2 if pieces else 0
        d_at = at + len(_DOC)
        s_at = d_at + len(d) + len(_SCORE)
        cuts.extend((d_at, d_at + len(d), s_at, s_at + len(s)))
        pieces.append(_DOC + d + _SCORE + s + b"}")
        at += len(pieces[-1])
    return EncodedHits(_list(pieces), cuts.tobytes())


def retrieve_body(answers: list[EncodedHits], scores: bool) -> bytes:
    """`/retrieve`: `{"result": [...]}`, per query its scored hits or (Search-R1 without scores) the
    bare documents."""
    return b'{"result": ' + _list([a.scored if scores else a.docs() for a in answers]) + b"}"


def search_body(answer: EncodedHits, scores: bool) -> bytes:
    """`/search`: the documents, or `[documents, scores]`."""
    return _list([answer.docs(), answer.scores()]) if scores else answer.docs()


def batch_search_body(answers: list[EncodedHits], scores: bool) -> bytes:
    """`/batch_search`: per query its documents, or `[per query documents, per query scores]`."""
    docs = _list([a.docs() for a in answers])
    return _list([docs, _list([a.scores() for a in answers])]) if scores else docs
