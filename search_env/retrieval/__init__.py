"""The retrieval service: a wiki-18 corpus, an E5 + faiss (or BM25) backend and a FastAPI server.

It answers `POST /retrieve` (Search-R1), `/search` and `/batch_search` (FlashRAG) with top-k
passages, micro-batching concurrent requests. Start it with `python -m search_env serve ...`.
"""
