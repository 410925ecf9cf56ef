"""The model card (``README.md``) of a saved retriever, in the Hugging Face Hub's format.

YAML metadata first (``library_name``, ``pipeline_tag``, ``tags``, ``base_model`` when it is a Hub id, and a
``dpr_gc`` block with the recipe, a LoRA folder's adapter settings and base model, and the training run: data files
and counts, batch and chunk sizes, chunk token limits and memory budget, loss, temperature, hard negatives, steps,
dev metrics), then the same in prose and how to load the folder with sentence-transformers, transformers and
dpr-gc. The training part comes from ``Retriever.training_info``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..base.files import atomic_open
from .pretrained import is_adapted
from .tokenize import eos_to_append, lowercases

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
TRAINING_ROWS = (("base_model", "base model"), ("train_data", "training data"), ("dev_file", "dev data"),
                 ("loss", "loss"), ("batch_size", "batch (queries per step, all ranks)"),
                 ("hard_negatives", "hard negatives per query"), ("other_negatives", "other negatives per query"),
                 ("grad_cache", "Gradient Cache"), ("query_chunk_size", "query chunk"),
                 ("passage_chunk_size", "passage chunk"), ("query_chunk_tokens", "query chunk token limit"),
                 ("passage_chunk_tokens", "passage chunk token limit"),
                 ("memory_budget", "memory budget (bytes of graphs kept)"), ("learning_rate", "learning rate"),
                 ("warmup_steps", "warmup steps"), ("epochs", "epochs done"), ("steps", "steps done"),
                 ("total_steps", "steps planned"), ("precision", "precision"), ("seed", "seed"))

SHOWN_BREAKS = str.maketrans({"\n": "\\n", "\r": "\\r", "\t": "\\t"})  # a table cell holds one line


def model_settings(retriever: Any) -> dict:
    """The recipe as the card states it (and as ``retriever_config.json`` stores it)."""
    config = retriever.config
    return {"towers": "shared" if retriever.passage_encoder is retriever.query_encoder else "separate",
            "pooling": config.pooling, "normalize": config.normalize, "projection_dim": config.projection_dim,
            "dimension": retriever.dim, "similarity": "cosine" if config.normalize else "dot",
            "temperature": round(float(retriever.temperature.detach()), 6),
            "learn_temperature": config.learn_temperature, "query_max_length": config.query_max_length,
            "passage_max_length": config.passage_max_length, "passage_format": config.passage_format,
            "query_prefix": config.query_prefix, "passage_prefix": config.passage_prefix,
            **({"lora": lora} if (lora := lora_settings(retriever)) else {})}


def lora_settings(retriever: Any) -> dict:
    """The LoRA adapter the towers carry (the query tower's), as the card states it; empty when they carry none."""
    towers = (retriever.query_encoder, retriever.passage_encoder)
    model = next((e.transformer for e in towers if is_adapted(e.transformer)), None)
    if model is None:
        return {}
    config = model.peft_config["default"]
    targets = config.target_modules
    return {"r": config.r, "alpha": config.lora_alpha, "dropout": config.lora_dropout,
            "target_modules": targets if isinstance(targets, str) else sorted(targets),
            "base_model": str(config.base_model_name_or_path)}


def hub_metadata(retriever: Any) -> dict:
    info = retriever.training_info
    meta: dict[str, Any] = {"library_name": "sentence-transformers", "pipeline_tag": "sentence-similarity",
                            "tags": ["sentence-transformers", "sentence-similarity", "feature-extraction",
                                     "dense-retrieval", "dpr-gc", "gradient-cache"]}
    base = info.get("base_model")
    if isinstance(base, str) and HUB_ID.match(base) and not Path(base).exists():
        meta["base_model"] = base
    meta["dpr_gc"] = {"format_version": 2, "model": model_settings(retriever)}
    if info:
        meta["dpr_gc"]["training"] = dict(info)
    return meta


def card_training(folder: Path) -> dict:
    """The ``training`` block of the ``dpr_gc`` metadata of the model card in ``folder``: what a run recorded of itself
    (steps done, data, batch, ...); empty when the folder has no card or the card has no such block."""
    import yaml

    try:
        text = (folder / "README.md").read_text(encoding="utf-8")
        meta = yaml.safe_load(text.split("---\n")[1]) if text.startswith("---\n") else None
    except (OSError, UnicodeDecodeError, IndexError, yaml.YAMLError):
        return {}
    block = meta.get("dpr_gc") if isinstance(meta, dict) else None
    training = block.get("training") if isinstance(block, dict) else None
    return training if isinstance(training, dict) else {}


def write_model_card(folder: Path, retriever: Any) -> None:
    """Write ``folder/README.md`` (atomically)."""
    import yaml

    meta = hub_metadata(retriever)
    text = "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n\n" + _body(retriever)
    with atomic_open(folder / "README.md") as f:
        f.write(text)


def _body(retriever: Any) -> str:
    settings = model_settings(retriever)
    info = retriever.training_info
    shared = settings["towers"] == "shared"
    towers = "one shared tower" if shared else "separate query and passage towers"
    lines = ["# Dense retriever (dpr-gc)", "",
             f"A bi-encoder for dense passage retrieval ({towers}), saved by dpr-gc as a sentence-transformers "
             "model folder.", "",
             "## Model", "", "| setting | value |", "|---|---|"]
    lines += [f"| {key.replace('_', ' ')} | {_lora_cell(value) if key == 'lora' else _cell(value)} |"
              for key, value in settings.items()]
    if "lora" in settings:
        lines += ["", f"The towers hold LoRA adapters over the base model `{settings['lora']['base_model']}`, which "
                  "loading needs (with `peft` installed); `dpr-gc merge-lora` writes a folder of full weights."]
    rows = [(label, info[key]) for key, label in TRAINING_ROWS if key in info]
    if rows:
        lines += ["", "## Training", "", "| setting | value |", "|---|---|"]
        lines += [f"| {label} | {_cell(value)} |" for label, value in rows]
    if info.get("dev_metrics"):
        lines += ["", f"## Dev metrics (step {info.get('dev_metrics_step', '?')})", "", "| metric | value |",
                  "|---|---|"]
        lines += [f"| {name} | {value:.4f} |" for name, value in info["dev_metrics"].items()]
    if info.get("imported_from"):
        lines += ["", "Imported from " + ", ".join(f"`{v}` ({k})" for k, v in info["imported_from"].items()) + "."]
    if info.get("merged_from"):
        lines += ["", f"LoRA adapters of `{info['merged_from']}` merged into its weights."]
    return "\n".join(lines + ["", _usage(retriever, shared)]) + "\n"


def _lora_cell(lora: dict) -> str:
    targets = lora["target_modules"]
    return (f"r={lora['r']} alpha={lora['alpha']:g} dropout={lora['dropout']:g} on "
            f"{targets if isinstance(targets, str) else ','.join(targets)}")


def _cell(value: Any) -> str:
    """``value`` as one Markdown table cell: a string as a code span (:func:`_code`), a list or dict joined; a line
    break shown as ``\\n`` and ``|`` escaped, so a multi-line instruction prefix keeps its row (the YAML metadata
    holds the value itself)."""
    if isinstance(value, list):
        return "; ".join(_cell(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()).translate(SHOWN_BREAKS).replace("|", "\\|")
    if isinstance(value, str):
        return _code(value).replace("|", "\\|") if value else '`""`'
    return str(value)


def _code(text: str) -> str:
    """``text`` as a Markdown code span that shows it whole: line breaks and tabs shown escaped, fenced by more
    backticks than it holds in a row, and padded with a space where it holds a backtick or starts and ends with a
    space (which Markdown strips one of)."""
    text = text.translate(SHOWN_BREAKS)
    run = max((len(ticks) for ticks in re.findall(r"`+", text)), default=0)
    pad = " " if run or (text.startswith(" ") and text.endswith(" ") and text.strip()) else ""
    return f"{'`' * (run + 1)}{pad}{text}{pad}{'`' * (run + 1)}"


def _usage(retriever: Any, shared: bool) -> str:
    """The card's usage section: sentence-transformers, transformers and dpr-gc snippets that embed as dpr-gc does
    (the EOS dpr-gc appends under last-token pooling written into the texts where the tokenizer does not add it)."""
    config = retriever.config
    eos = eos_to_append(retriever.tokenizer, config) is not None
    plus = " + eos" if eos else ""
    passages = (f'[("Title", "Passage text."{plus})])  # (title, text) pairs; untitled passages as plain strings'
                if config.passage_format == "pair" else f'["Title Passage text."{plus}])  # title + " " + text')
    eos_line = ([f"eos = {retriever.tokenizer.eos_token!r}  # dpr-gc ends every text with it (last-token pooling)"]
                if eos else [])
    st = ["## Usage", "", "### sentence-transformers", ""] + _separate_lora_note(retriever, shared) + ["```python",
          "from sentence_transformers import SentenceTransformer", "",
          'model = SentenceTransformer("path/to/this/folder")', *eos_line,
          f'queries = model.encode_query(["Who wrote On the Origin of Species?"{plus}])  # adds the query prefix',
          f"passages = model.encode_document({passages}",
          "scores = model.similarity(queries, passages)", "```", "",
          "`encode_query` / `encode_document` apply the stored prefixes and max lengths"
          + ("" if shared else " and pick the tower (a `Router`)") + ", so the embeddings equal dpr-gc's"
          + (" once each text ends with the tokenizer's EOS token, which dpr-gc appends under last-token pooling "
             "and sentence-transformers does not; a text cut at the max length loses that EOS, where dpr-gc keeps "
             "it as the last token." if eos else ".")]
    if config.passage_format == "pair":
        st[-1] += (" A passage whose title takes more than half the passage length is cut differently "
                   "(sentence-transformers truncates the longer of title and text; dpr-gc the text first).")
    lower = lowercases(retriever.tokenizer)
    return "\n".join(st + _transformers_usage(config, shared, lower, eos) + _dpr_gc_usage()) + "\n"


def _separate_lora_note(retriever: Any, shared: bool) -> list[str]:
    """The card's word that sentence-transformers loads separate LoRA towers only once merged: its ``Router`` looks
    for each tower's base model in that tower's subfolder of the base model's folder."""
    if shared or not any(is_adapted(e.transformer) for e in (retriever.query_encoder, retriever.passage_encoder)):
        return []
    return ["The towers are separate LoRA adapters, which `SentenceTransformer` cannot load (it looks for each "
            "tower's base model in a subfolder of the base); `dpr-gc merge-lora --model path/to/this/folder "
            "--output merged` writes a folder it loads as below.", ""]


def _transformers_usage(config: Any, shared: bool, lower: bool, eos: bool) -> list[str]:
    """The card's transformers snippet embedding questions (separate towers: with the query tower's subfolder, after
    a word on both); ``eos``: the texts end with the EOS token the tokenizer does not add."""
    folder = "path/to/this/folder" if shared else "path/to/this/folder/query_0_Transformer"
    towers = [] if shared else [
        "The towers are Hugging Face models in `query_0_Transformer/` and `document_0_Transformer/` (each with its "
        "tokenizer): load each with `AutoModel` / `AutoTokenizer` and pool as below (the query tower shown; "
        f"passages go through `document_0_Transformer/` the same way, with the passage prefix and max_length="
        f"{config.passage_max_length}).", ""]
    text = f"({config.query_prefix!r} + q).lower()" if lower else f"{config.query_prefix!r} + q"  # do_lower_case
    text += " + tokenizer.eos_token" if eos else ""
    pool = {"mean": "(hidden * mask).sum(1) / mask.sum(1)", "cls": "hidden[:, 0]",
            "pooler": "model(**batch).pooler_output",
            "last": "hidden[torch.arange(len(hidden)), (mask[..., 0] * torch.arange(1, hidden.size(1) + 1)).argmax(1)]"
            "  # each text's last real token"}[config.pooling]
    lines = ["", "### transformers", "", *towers, "```python", "import torch",
             "from transformers import AutoModel, AutoTokenizer", "",
             'tokenizer = AutoTokenizer.from_pretrained("{}")'.format(folder),
             'model = AutoModel.from_pretrained("{}")'.format(folder),
             'questions = ["Who wrote On the Origin of Species?"]',
             f"batch = tokenizer([{text} for q in questions], truncation=True, "
             f"max_length={config.query_max_length}, padding=True, return_tensors=\"pt\")",
             "hidden = model(**batch).last_hidden_state", "mask = batch[\"attention_mask\"].unsqueeze(-1).float()",
             f"embeddings = {pool}"]
    if config.projection_dim:
        lines.append("# then the linear projection stored in the Dense folder (model.safetensors: linear.weight/bias)")
    if config.normalize:
        lines.append("embeddings = torch.nn.functional.normalize(embeddings, dim=-1)")
    return lines + ["```"]


def _dpr_gc_usage() -> list[str]:
    return ["", "### dpr-gc", "", "```bash",
            "dpr-gc encode --model path/to/this/folder --corpus passages.tsv --output emb",
            "dpr-gc index --embeddings emb --output index && dpr-gc retrieve --index index --queries qa.csv "
            "--output results.json --evaluate", "```", "", "```python", "from dpr_gc import Retriever", "",
            'retriever = Retriever.load("path/to/this/folder")',
            'vectors = retriever.embed("query", ["Who wrote On the Origin of Species?"])', "```"]
