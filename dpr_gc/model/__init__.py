"""The retriever: query and passage towers over a Hugging Face model, and everything that reads or writes one.

Built on :mod:`dpr_gc.engine` (the losses a retriever carries) and :mod:`dpr_gc.base`; knows nothing of data files
or stages. Inside, each module imports only modules of the steps before its own (``tests/test_layers.py`` checks it,
imports inside functions included):

1. ``config``, ``tokenize``, ``hub``, ``fsdp`` -- :class:`RetrieverConfig`, the recipe (pooling, lengths,
   prefixes, temperature); the one place text becomes token ids; where a model name leads (a folder, the Hub,
   refused within seconds offline); FSDP2 sharding;
2. ``pretrained`` -- Hugging Face models and tokenizers in, a PEFT adapter folder on top of its base model;
3. ``dpr_hub``, ``dpr_checkpoints``, ``card`` -- DPR's two formats in; the model card (its usage lower-cases text as
   the tokenizer does, and says what loads a LoRA adapter);
4. ``folder`` -- saved retriever folders (sentence-transformers and transformers layouts) written and read;
5. ``retriever`` -- :class:`Retriever` itself, whose ``load`` / ``save`` call the loaders above, passing its own
   class so that they build it without importing it;
6. ``lora`` -- LoRA adapters put on a retriever's towers, and the ``merge-lora`` command.
"""
