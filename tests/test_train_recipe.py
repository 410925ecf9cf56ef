"""Issue 30: fine-tuning a sentence-transformers folder keeps its recipe (pooling, normalisation, passage format,
max lengths, prompts as prefixes; temperature 0.05 as its MultipleNegativesRankingLoss) unless a flag says
otherwise, and says what it took."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from transformers import BertTokenizerFast

from dpr_gc.cli import build_parser
from dpr_gc.model.retriever import Retriever, RetrieverConfig
from dpr_gc.train.config import ModelConfig, config_from_args
from dpr_gc.train.trainer import train
from dpr_gc.train.setup import build_retriever, resolve_recipe
from tests.helpers import tiny_bert, write_vocab
from tests.train_data import make_records, train_config, write_dpr

RECIPE = dict(pooling="mean", normalize=True, passage_format="concat", query_max_length=20, passage_max_length=40,
              query_prefix="q: ", passage_prefix="p: ")


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sentence-transformers folder (Transformer -> Pooling(mean) -> Normalize, prompts) that is not a dpr-gc
    retriever: what a user downloads."""
    folder = tmp_path_factory.mktemp("st")
    tokenizer = BertTokenizerFast(vocab=str(write_vocab(folder / "vocab.txt")), do_lower_case=True)
    Retriever(tiny_bert(len(tokenizer)), None, tokenizer, RetrieverConfig(**RECIPE)).save(folder / "model")
    for name in ("retriever_config.json", "heads.safetensors"):
        (folder / "model" / name).unlink()
    return folder / "model"


def parsed(*flags: str):
    args = build_parser().parse_args(["train", "--train", "x.json", "--output", "out", *flags])
    return config_from_args(args)


def test_a_sentence_transformers_folder_gives_the_defaults(st_folder: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        config = build_retriever(parsed("--model", str(st_folder)).model).config
    for key, value in RECIPE.items():
        assert getattr(config, key) == value, key
    assert config.temperature == 0.05
    assert "is a sentence-transformers folder; its recipe: pooling='mean', normalize=True" in caplog.text
    assert "temperature=0.05" in caplog.text


def test_flags_override_the_folder(st_folder: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        config = build_retriever(parsed("--model", str(st_folder), "--pooling", "cls", "--no-normalize",
                                        "--passage-max-length", "24", "--query-prefix", "").model).config
    assert (config.pooling, config.normalize, config.passage_max_length, config.query_prefix) == ("cls", False, 24, "")
    assert (config.passage_format, config.query_max_length, config.passage_prefix) == ("concat", 20, "p: ")
    assert config.temperature == 1.0  # not normalised: dot products, no sentence-transformers scale
    assert "(given: pooling='cls', normalize=False, passage_max_length=24, query_prefix='')" in caplog.text
    assert parsed("--model", str(st_folder), "--temperature", "0.2").model.retriever.temperature == 0.2


def test_a_recipe_given_in_code_replaces_only_the_fields_it_changes(st_folder: Path, tmp_path: Path) -> None:
    """``ModelConfig(retriever=RetrieverConfig(temperature=0.05))`` trained a sentence-transformers folder with CLS
    pooling, no normalisation, pair passages and 32-token queries (every field taken as given), where
    ``--temperature 0.05`` keeps the folder's recipe: in code as on the command line, the fields changed from the
    defaults replace the folder's."""
    model = ModelConfig(name=str(st_folder), retriever=RetrieverConfig(temperature=0.2, passage_max_length=24))
    config = build_retriever(model).config
    assert (config.pooling, config.normalize, config.passage_format) == ("mean", True, "concat")
    assert (config.query_max_length, config.passage_max_length, config.temperature) == (20, 24, 0.2)
    assert resolve_recipe(model).retriever == config
    data = write_dpr(tmp_path / "train.json", make_records(16, 0))
    train(train_config(model=str(st_folder), retriever=model.retriever, train_files=[str(data)], batch_size=8,
                       output_dir=str(tmp_path / "out"), num_workers=0, max_steps=1, query_chunk_size=4,
                       passage_chunk_size=4, cache_dir=str(tmp_path / "cache")))
    saved = json.loads((tmp_path / "out" / "final" / "retriever_config.json").read_text())
    assert (saved["pooling"], saved["normalize"], saved["passage_max_length"]) == ("mean", True, 24)


def test_a_plain_transformers_folder_keeps_the_dpr_defaults(tmp_path: Path) -> None:
    tokenizer = BertTokenizerFast(vocab=str(write_vocab(tmp_path / "vocab.txt")))
    tiny_bert(len(tokenizer)).save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    config = build_retriever(parsed("--model", str(tmp_path / "bert")).model).config
    assert (config.pooling, config.normalize, config.passage_format, config.temperature) == ("cls", False, "pair", 1.0)
    assert (config.query_max_length, config.passage_max_length) == (32, 128)  # 256, cut to the model's positions


def test_training_a_sentence_transformers_folder_saves_its_recipe(st_folder: Path, tmp_path: Path) -> None:
    data = write_dpr(tmp_path / "train.json", make_records(16, 0))
    train(train_config(model=str(st_folder), train_files=[str(data)], output_dir=str(tmp_path / "out"),
                       batch_size=8, num_workers=0, max_steps=1, query_chunk_size=4, passage_chunk_size=4,
                       cache_dir=str(tmp_path / "cache")))
    saved = json.loads((tmp_path / "out" / "final" / "retriever_config.json").read_text())
    for key, value in RECIPE.items():
        assert saved[key] == value, key
    assert abs(saved["temperature"] - 0.05) < 1e-6


def test_the_folders_projection_is_kept_with_its_weights(tmp_path: Path) -> None:
    """docs/training.md: the recipe keeps the folder's projection (its Dense module), weights included, so the
    starting retriever embeds as the folder does."""
    import torch

    tokenizer = BertTokenizerFast(vocab=str(write_vocab(tmp_path / "vocab.txt")), do_lower_case=True)
    original = Retriever(tiny_bert(len(tokenizer)), None, tokenizer, RetrieverConfig(**RECIPE, projection_dim=8))
    original.save(tmp_path / "model")
    for name in ("retriever_config.json", "heads.safetensors"):
        (tmp_path / "model" / name).unlink()
    assert (tmp_path / "model" / "2_Dense").is_dir()
    started = build_retriever(parsed("--model", str(tmp_path / "model")).model)
    assert started.config.projection_dim == 8
    texts = ["what is a river", "the city of paris"]
    torch.testing.assert_close(torch.as_tensor(started.embed("query", texts)),
                               torch.as_tensor(original.embed("query", texts)), rtol=0, atol=1e-5)


def test_separate_towers_from_a_folder_with_a_projection_start_from_its_weights(tmp_path: Path) -> None:
    """docs/training.md: ``--separate-encoders`` on a shared sentence-transformers folder with a Dense projection
    gives two copies of its tower, projection weights included, so both embed as the folder does before any step
    (the passage tower once got a new, random projection)."""
    import torch

    tokenizer = BertTokenizerFast(vocab=str(write_vocab(tmp_path / "vocab.txt")), do_lower_case=True)
    original = Retriever(tiny_bert(len(tokenizer)), None, tokenizer, RetrieverConfig(**RECIPE, projection_dim=8))
    original.save(tmp_path / "model")
    for name in ("retriever_config.json", "heads.safetensors"):
        (tmp_path / "model" / name).unlink()
    started = build_retriever(parsed("--model", str(tmp_path / "model"), "--separate-encoders").model)
    assert not started.config.shared_encoder and started.config.projection_dim == 8
    assert started.passage_encoder.transformer is not started.query_encoder.transformer
    texts = ["what is a river", "the city of paris"]
    for kind in ("query", "passage"):
        torch.testing.assert_close(torch.as_tensor(started.embed(kind, texts)),
                                   torch.as_tensor(original.embed(kind, texts)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("max_seq_length, lengths", [(100, (64, 100)), (40, (40, 40))])  # the model: 128 positions
def test_a_folder_without_a_query_length_caps_queries_at_64_tokens(st_folder: Path, tmp_path: Path,
                                                                   max_seq_length: int, lengths: tuple) -> None:
    """docs/training.md: a sentence-transformers folder that sets only ``max_seq_length`` (all-MiniLM-L6-v2: 256)
    gives passages that length and queries at most 64 tokens."""
    import shutil

    folder = Path(shutil.copytree(st_folder, tmp_path / "model"))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    config = build_retriever(parsed("--model", str(folder)).model).config
    assert (config.query_max_length, config.passage_max_length) == lengths


def test_the_copy_that_fsdp_saves_does_not_say_the_recipe_again(st_folder: Path, caplog, monkeypatch) -> None:
    """Under --fsdp each save (final/, every new best/) builds an unsharded copy of the model to gather the weights
    into; the start-up log said the folder's recipe once, the copies do not say it again."""
    from dpr_gc.train import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "unsharded_copy", lambda model, build, is_main: build())
    config = parsed("--model", str(st_folder), "--fsdp")
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        trainer = trainer_module.Trainer.__new__(trainer_module.Trainer)
        trainer.config, trainer.rank, trainer.retriever = config, 0, build_retriever(config.model)
        said = caplog.text.count("its recipe")
        copy = trainer.export()
    assert said == 1 and caplog.text.count("its recipe") == 1, caplog.text
    assert copy is not trainer.retriever and copy.config == trainer.retriever.config


@pytest.mark.parametrize("model_type, said", [("bert", "a bert model"), ("albert", "an albert model"),
                                              ("electra", "an electra model"), ("roberta", "a roberta model"),
                                              ("mpnet", "an mpnet model"), ("xlm-roberta", "an xlm-roberta model"),
                                              ("mt5", "an mt5 model"), ("nomic_bert", "a nomic_bert model"),
                                              ("squeezebert", "a squeezebert model"),
                                              ("longformer", "a longformer model"),
                                              ("flaubert", "a flaubert model"), ("unispeech", "a unispeech model")])
def test_the_plain_model_line_takes_the_article_of_the_model_type(caplog, model_type, said):
    """The pooling line of a plain Hugging Face model takes the article of the model type's sound: "a bert model", "an
    albert model", "an mpnet model" (an initialism read letter by letter), "a unispeech model"."""
    from types import SimpleNamespace

    from dpr_gc.model.retriever import plain_model_recipe

    model = SimpleNamespace(config=SimpleNamespace(model_type=model_type, is_decoder=False, architectures=None))
    with caplog.at_level(logging.INFO, logger="dpr_gc.model.retriever"):
        plain_model_recipe("m", model, RetrieverConfig(), chosen=())
    assert f"m: {said}: pooling" in caplog.text


def test_a_decoder_run_records_the_recipe_and_lora_settings_it_trained_with(tmp_path: Path) -> None:
    """docs/training.md: a plain decoder folder trained without --pooling records the last-token pooling, concat
    passages and LoRA alpha and targets it took (it recorded cls, pair and nulls), so --resume takes those values
    given as flags; a record of an earlier version (cls/pair, null alpha and targets) resumes with the original
    command line, and with the values used, as the recipe its checkpoint was trained with."""
    from dpr_gc.cli import main
    from dpr_gc.model.lora import DECODER_TARGETS
    from tests.helpers import call
    from tests.llm_models import save_decoder

    base = save_decoder(tmp_path / "base", "llama", padding_side="left")
    data = write_dpr(tmp_path / "train.json", make_records(8, 1))
    out = tmp_path / "run"
    flags = ["train", "--train", data, "--model", base, "--batch-size", "4", "--num-workers", "0", "--device", "cpu",
             "--cache-dir", tmp_path / "c", "--lora-r", "4", "--lora-dropout", "0.1", "--output", out]
    code, err = call(main, [*flags, "--max-steps", "1", "--save-every", "1"])
    assert code == 0, err
    record = json.loads((out / "checkpoint-1" / "train_config.json").read_text())["model"]
    assert (record["retriever"]["pooling"], record["retriever"]["passage_format"]) == ("last", "concat")
    targets = sorted(DECODER_TARGETS)
    assert record["lora"] == {"r": 4, "alpha": 8.0, "dropout": 0.1, "target_modules": targets}, record["lora"]
    given = ["--pooling", "last", "--passage-format", "concat", "--lora-alpha", "8",
             "--lora-target-modules", ",".join(targets)]
    old = dict(record, retriever=dict(record["retriever"], pooling="cls", passage_format="pair"),
               lora=dict(record["lora"], alpha=None, target_modules=None))
    for older in (False, True):
        if older:
            for path in (out / "train_config.json", out / "checkpoint-1" / "train_config.json"):
                path.write_text(json.dumps(dict(json.loads(path.read_text()), model=old)))
        for extra in ([], given):
            code, err = call(main, [*flags, *extra, "--max-steps", "2", "--resume", out / "checkpoint-1"])
            assert code == 0, (older, extra, err)


def test_an_earlier_decoder_record_without_a_saved_model_is_read_as_the_decoder_recipe(tmp_path: Path) -> None:
    """A checkpoint that saves no model (FSDP's sharded one) of an earlier version's decoder run: a recorded cls
    pooling, which no decoder trains with, is the unresolved default, read as the decoder's last/concat; a pooling
    the run took (last) keeps the passage format recorded, and the LoRA nulls are the defaults the run took."""
    from dpr_gc.base.settings import to_record
    from dpr_gc.train.setup import resolve_recorded_recipe
    from tests.llm_models import save_decoder

    base = save_decoder(tmp_path / "base", "qwen2")
    retriever = to_record(RetrieverConfig())
    lora = {"r": 2, "alpha": None, "dropout": 0.0, "target_modules": None}
    old = {"model": {"name": str(base), "retriever": retriever, "lora": lora}}
    model = resolve_recorded_recipe(old, tmp_path / "checkpoint-1")["model"]
    assert (model["retriever"]["pooling"], model["retriever"]["passage_format"]) == ("last", "concat")
    assert model["lora"]["alpha"] == 4.0 and model["lora"]["target_modules"][:2] == ["down_proj", "gate_proj"]
    taken = dict(old, model=dict(old["model"], retriever=dict(retriever, pooling="last"), lora=None))
    assert resolve_recorded_recipe(taken, tmp_path / "checkpoint-1")["model"]["retriever"]["passage_format"] == "pair"
    unread = dict(old, model=dict(old["model"], name=str(tmp_path / "gone")))  # no config to read: as recorded
    assert resolve_recorded_recipe(unread, None) == unread
