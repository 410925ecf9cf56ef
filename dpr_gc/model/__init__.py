"""The retriever: query and passage towers over a Hugging Face model, and everything that reads or writes one.

Pooling and the retriever itself, tokenisation, saved folders (sentence-transformers and transformers layouts, the
model card), LoRA adapters, FSDP2 sharding and the DPR checkpoint formats. Built on :mod:`dpr_gc.engine` (the
losses a retriever carries) and :mod:`dpr_gc.base`; knows nothing of data files or stages.
"""
