"""The retriever: query and passage towers over a Hugging Face model, and everything that reads or writes one.

Built on :mod:`dpr_gc.engine` (the losses a retriever carries) and :mod:`dpr_gc.base`; knows nothing of data files
or stages. Inside, each module imports only those before it (``tests/test_layers.py`` checks it, imports inside
functions included):

1. ``config`` -- :class:`RetrieverConfig`, the recipe (pooling, lengths, prefixes, temperature);
2. ``tokenize`` -- the one place text becomes token ids;
3. ``pretrained`` -- Hugging Face models and tokenizers in, a PEFT adapter folder on top of its base model;
4. ``dpr_hub``, ``dpr_checkpoints``, ``card``, ``fsdp`` -- DPR's two formats in, the model card out, FSDP2 sharding;
5. ``folder`` -- saved retriever folders (sentence-transformers and transformers layouts) written and read;
6. ``retriever`` -- :class:`Retriever` itself, whose ``load`` / ``save`` call the loaders above, passing its own
   class so that they build it without importing it;
7. ``lora`` -- LoRA adapters put on a retriever's towers, and the ``merge-lora`` command.
"""
