"""The stages after training: encode a corpus into shards, index them with FAISS, retrieve top-k, mine hard negatives.

Each module is one stage with its own command; they share the shard and index formats defined here.
"""
