"""Search environment: retrieval (corpus, encoder, index, BM25, server, client), protocol, verl tool and agent loop, datasets."""
