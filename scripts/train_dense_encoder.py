#!/usr/bin/env python
"""GC-DPR-compatible entry point: ``train_dense_encoder.py --grad_cache --q_chunk_size 16 --ctx_chunk_size 8 ...``.

Every ``dpr-gc train`` flag works here, and so do GC-DPR's names: --train_file, --dev_file, --output_dir,
--pretrained_model_cfg, --batch_size, --hard_negatives, --other_negatives, --grad_cache, --q_chunk_size,
--ctx_chunk_size, --fp16, --learning_rate, --warmup_steps, --num_train_epochs, --max_grad_norm, --weight_decay,
--shuffle_positive_ctx, --sequence_length (the passage max length).
"""

import sys

from dpr_gc.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
