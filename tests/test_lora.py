"""LoRA (peft) on the towers: only adapters train, Gradient Cache stays exact, a saved adapter loads for encode and
gives the in-memory model's embeddings, and ``merge-lora`` writes full weights that embed alike."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dpr_gc.cli import main
from dpr_gc import Chunking
from dpr_gc.base.errors import DprGcError
from dpr_gc.model.card import card_training
from dpr_gc.model.lora import LoraSettings, apply_lora, is_adapted
from dpr_gc.model.retriever import Retriever, enable_gradient_checkpointing
from tests.llm_models import save_decoder
from tests.helpers import gather, randomise_adapters
from tests.helpers import models_of
from tests.llm_models import cached_step_error, decoder_retriever, TEXTS
from tests.train_data import init_model

PASSAGES = [{"id": f"p{i}", "title": t, "text": x} for i, (t, x) in enumerate(
    [("paris", "the city of france on the river"), ("", "a war of the king of london"),
     ("music", "a film with music from london"), ("", "what is a gene")])]


def adapter_only(retriever: Retriever) -> bool:
    trainable = [n for e in models_of(retriever) for n, p in e.transformer.named_parameters() if p.requires_grad]
    return bool(trainable) and all("lora_" in n for n in trainable)


@pytest.mark.parametrize("shared", [True, False])
def test_lora_gradient_cache_equals_full_batch_on_bert(make_retriever, shared):
    retriever = make_retriever(shared=shared)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        apply_lora(retriever, LoraSettings(r=4))
    assert not [w for w in seen if issubclass(w.category, FutureWarning)], [str(w.message) for w in seen]
    lora = retriever.query_encoder.transformer.peft_config["default"]  # the documented defaults: alpha 2 x r, no dropout
    assert (lora.lora_alpha, lora.lora_dropout) == (8, 0.0)
    randomise_adapters(retriever)
    assert adapter_only(retriever)
    assert any(".pooler." in n for n, _ in retriever.named_parameters() if "lora_" in n)  # adapted but frozen
    assert cached_step_error(retriever, 2) < 1e-5
    adapter_grads = [p.grad for m in models_of(retriever) for n, p in m.named_parameters()
                     if "lora_" in n and p.requires_grad]
    assert all(g is not None and g.abs().sum() > 0 for g in adapter_grads)


@pytest.mark.parametrize("kind,checkpointing", [("llama", False), ("qwen2", True)])
def test_lora_gradient_cache_equals_full_batch_on_left_padded_decoders(kind, checkpointing):
    retriever = decoder_retriever(kind, "left")
    apply_lora(retriever, LoraSettings(r=4, target_modules=None))
    randomise_adapters(retriever)
    if checkpointing:
        enable_gradient_checkpointing(retriever)
        retriever.train()
    assert adapter_only(retriever)
    targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in retriever.named_parameters() if "lora_A" in n}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert cached_step_error(retriever, 4, chunking=Chunking(sort_by_length=True)) < 1e-5


def test_saved_adapter_loads_and_encodes_like_the_in_memory_model(tmp_path, capsys):
    base = save_decoder(tmp_path / "base", "llama", padding_side="left")
    retriever = Retriever.from_pretrained(str(base), decoder_retriever().config)
    apply_lora(retriever, LoraSettings(r=4, alpha=16))
    randomise_adapters(retriever, seed=3)
    retriever.save(tmp_path / "lora")
    tower = tmp_path / "lora"
    assert (tower / "adapter_config.json").is_file() and (tower / "adapter_model.safetensors").is_file()
    assert not (tower / "model.safetensors").exists()  # the base weights stay in the base folder
    assert json.loads((tower / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base.resolve())

    titles, texts = [p["title"] for p in PASSAGES], [p["text"] for p in PASSAGES]
    expected = retriever.embed("passage", texts, titles)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = Retriever.load(tmp_path / "lora")
    assert not [w for w in seen if issubclass(w.category, FutureWarning)], [str(w.message) for w in seen]
    assert is_adapted(loaded.query_encoder.transformer)
    np.testing.assert_allclose(loaded.embed("passage", texts, titles), expected, rtol=0, atol=1e-6)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in PASSAGES))
    assert main(["encode", "--model", str(tmp_path / "lora"), "--corpus", str(corpus), "--output", str(tmp_path / "emb"),
                 "--dtype", "float32", "--precision", "fp32", "--cache-dir", str(tmp_path / "c"), "--device", "cpu"]) == 0
    np.testing.assert_allclose(gather(tmp_path / "emb")[1], expected, rtol=0, atol=1e-5)

    # training again from the saved retriever trains its adapter, nothing else
    assert not adapter_only(loaded)
    apply_lora(loaded, LoraSettings(r=4))
    assert adapter_only(loaded)

    capsys.readouterr()
    assert main(["merge-lora", "--model", str(tmp_path / "lora"), "--output", str(tmp_path / "merged")]) == 0
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = Retriever.load(tmp_path / "merged")
    size = f"{sum(p.numel() for p in merged.parameters()):,}"  # the closing table: towers, parameters, folder
    table = capsys.readouterr().out
    assert f"| towers merged | {1 if merged.config.shared_encoder else 2} |" in table, table
    assert f"| parameters | {size} |" in table and f"| output | {tmp_path / 'merged'} |" in table, table
    assert not is_adapted(merged.query_encoder.transformer)
    np.testing.assert_allclose(merged.embed("passage", texts, titles), expected, rtol=0, atol=1e-5)
    assert main(["merge-lora", "--model", str(tmp_path / "merged"), "--output", str(tmp_path / "again")]) == 2


def test_separate_lora_towers_round_trip(make_retriever, tmp_path):
    with pytest.raises(DprGcError, match="no folder"):  # an adapter needs a base that can be found again
        unsaved = make_retriever()
        apply_lora(unsaved, LoraSettings(r=2))
        unsaved.save(tmp_path / "unsaved")
    retriever = Retriever.load(init_model(tmp_path, shared=False))
    apply_lora(retriever, LoraSettings(r=2, target_modules=["query", "value"]))
    randomise_adapters(retriever, seed=5)
    retriever.save(tmp_path / "two")
    loaded = Retriever.load(tmp_path / "two")
    for kind in ("query", "passage"):
        np.testing.assert_allclose(loaded.embed(kind, TEXTS), retriever.embed(kind, TEXTS), rtol=0, atol=1e-6)



def test_merge_lora_replaces_only_a_folder_that_holds_a_model_and_nothing_else(tmp_path, capsys):
    """merge-lora's --output is replaced whole: a folder that merely holds a config.json, or a model folder holding
    the user's files beside the model, is refused in one line naming the first foreign entry, and left as it was."""
    retriever = Retriever.load(init_model(tmp_path, shared=False))
    apply_lora(retriever, LoraSettings(r=2))
    retriever.save(tmp_path / "lora")
    project = tmp_path / "proj"
    (project / "src").mkdir(parents=True)
    (project / "config.json").write_text("{}")
    (project / "src" / "main.py").write_text("print('mine')\n")
    merged = tmp_path / "merged"
    assert main(["merge-lora", "--model", str(tmp_path / "lora"), "--output", str(merged)]) == 0
    (merged / "notes.txt").write_text("mine")
    (merged / "query_1_Pooling" / "results").mkdir()
    for folder, foreign in ((project, project / "src"), (merged, merged / "notes.txt")):
        before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
        capsys.readouterr()
        assert main(["merge-lora", "--model", str(tmp_path / "lora"), "--output", str(folder)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and f"holds {foreign}," in err[0], err
        assert "--output" in err[0] and sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before
    (merged / "notes.txt").unlink()
    assert main(["merge-lora", "--model", str(tmp_path / "lora"), "--output", str(merged)]) == 2  # results/ too
    (merged / "query_1_Pooling" / "results").rmdir()
    assert main(["merge-lora", "--model", str(tmp_path / "lora"), "--output", str(merged)]) == 0  # a model alone
    Retriever.load(merged)


def test_merge_lora_refuses_a_folder_of_the_users_before_loading_the_model(tmp_path, capsys, monkeypatch):
    """The --output check comes before the minutes of loading the model: a folder holding the user's files is
    refused at once, and the model is never loaded."""
    retriever = Retriever.load(init_model(tmp_path, shared=False))
    apply_lora(retriever, LoraSettings(r=2))
    retriever.save(tmp_path / "lora")
    project = tmp_path / "proj"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    loaded = []
    monkeypatch.setattr(Retriever, "load", classmethod(lambda cls, *a, **k: loaded.append(a) or retriever))
    capsys.readouterr()
    assert main(["merge-lora", "--model", str(tmp_path / "lora"), "--output", str(project)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {project} is a folder that holds no saved model"), err
    assert loaded == [] and [p.name for p in project.iterdir()] == ["notes.txt"]

def test_merge_lora_keeps_the_training_record_of_the_model_card_and_notes_the_merge(tmp_path):
    """The merged retriever's card carries the adapted one's training record (base model, steps, dev metrics) and
    names the folder whose adapters it merged, in the metadata and in the prose."""
    retriever = Retriever.load(init_model(tmp_path, shared=False))
    apply_lora(retriever, LoraSettings(r=2))
    retriever.training_info.update(base_model="bert-tiny", steps=7, loss="infonce", dev_metrics={"mrr@10": 0.5},
                                   dev_metrics_step=7)
    retriever.save(tmp_path / "lora")
    assert main(["merge-lora", "--model", str(tmp_path / "lora"), "--output", str(tmp_path / "merged")]) == 0
    record = card_training(tmp_path / "merged")
    assert record == {**retriever.training_info, "merged_from": str(tmp_path / "lora")}, record
    card = (tmp_path / "merged" / "README.md").read_text(encoding="utf-8")
    assert "| steps done | 7 |" in card and "| mrr@10 | 0.5000 |" in card, card
    assert f"LoRA adapters of `{tmp_path / 'lora'}` merged into its weights." in card, card


def test_bad_lora_settings_are_refused(make_retriever):
    with pytest.raises(DprGcError, match="--lora-r"):
        LoraSettings(r=0)
    with pytest.raises(DprGcError, match="--lora-dropout"):
        LoraSettings(r=2, dropout=1.0)
    with pytest.raises(DprGcError, match="--lora-target-modules"):
        apply_lora(make_retriever(), LoraSettings(r=2, target_modules=["no_such_layer"]))


def test_lora_target_modules_in_code_take_a_list_of_names():
    """docs/library.md: a single string where a flag takes several values is refused in one line (it was read letter
    by letter: "q, u, e, r, y: no module ..."), as is a name that is not a str."""
    with pytest.raises(DprGcError) as refused:
        LoraSettings(r=4, target_modules="query")
    assert str(refused.value) == "--lora-target-modules takes a list of values, e.g. ['query'], got 'query'"
    with pytest.raises(DprGcError, match="^--lora-target-modules must be a str, got 5$"):
        LoraSettings(r=4, target_modules=["query", 5])
    assert list(LoraSettings(r=4, target_modules=("query", "value")).target_modules) == ["query", "value"]


@pytest.mark.slow  # 35 s in a full run under load 7-10 on 2 cores (2026-11-24)
def test_train_cli_with_lora_trains_only_adapters_and_resumes(tmp_path):
    """`dpr-gc train --lora-r` on a decoder folder: final/ is a PEFT adapter over the untouched base, and a run
    resumed from its first checkpoint ends with the same adapter as the uninterrupted one."""
    from safetensors.torch import load_file

    from tests.train_data import make_records, write_dpr

    base = save_decoder(tmp_path / "base", "qwen2", padding_side="left")
    data = write_dpr(tmp_path / "train.json", make_records(16, 1))
    flags = ["--train", str(data), "--model", str(base), "--pooling", "last", "--passage-format", "concat",
             "--batch-size", "4", "--query-chunk-size", "2", "--passage-chunk-size", "3", "--max-steps", "2",
             "--save-every", "1", "--num-workers", "0", "--learning-rate", "1e-2", "--cache-dir", str(tmp_path / "c"),
             "--lora-r", "4", "--lora-alpha", "8", "--lora-dropout", "0.1", "--device", "cpu"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["train", *flags, "--output", str(tmp_path / "run")]) == 0
    # peft calls a transformers property that warns of its deprecation: a user of the command line sees none of it
    assert not [w for w in seen if issubclass(w.category, FutureWarning)], [str(w.message) for w in seen]
    final = tmp_path / "run" / "final"
    adapter = load_file(str(final / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # trained away from PEFT's zeros
    settings = json.loads((final / "adapter_config.json").read_text())
    assert (settings["r"], settings["lora_alpha"], settings["lora_dropout"]) == (4, 8, 0.1)
    base_weights = load_file(str(base / "model.safetensors"))
    trained = Retriever.load(final).query_encoder.transformer.get_base_model().state_dict()
    for key, value in base_weights.items():
        name = key.rsplit(".", 1)
        here = trained.get(key, trained.get(f"{name[0]}.base_layer.{name[1]}"))
        assert here is not None and torch.equal(here, value), key

    shutil.rmtree(final)  # the resumed run must write final/ again, not leave the uninterrupted run's
    assert main(["train", *flags, "--output", str(tmp_path / "run"), "--resume",
                 str(tmp_path / "run" / "checkpoint-1")]) == 0
    resumed = load_file(str(final / "adapter_model.safetensors"))
    assert adapter.keys() == resumed.keys()
    for key in adapter:
        torch.testing.assert_close(resumed[key], adapter[key], rtol=0, atol=1e-6)
    assert main(["train", *flags[:-4], "--lora-dropout", "1.5", "--output", str(tmp_path / "x")]) == 2

    # continuing from the saved LoRA retriever without --lora-r trains its adapter further (it loads frozen)
    again = [*flags[:flags.index("--lora-r")], "--device", "cpu"]
    again[again.index("--model") + 1] = str(final)
    assert main(["train", *again, "--output", str(tmp_path / "more")]) == 0
    further = load_file(str(tmp_path / "more" / "final" / "adapter_model.safetensors"))
    assert further.keys() == adapter.keys()
    assert any(not torch.equal(further[k], adapter[k]) for k in adapter if "lora_B" in k)
    settings = json.loads((tmp_path / "more" / "final" / "adapter_config.json").read_text())
    assert (settings["r"], settings["lora_alpha"]) == (4, 8)  # the saved adapter's shape, not new defaults


def test_lora_and_decoder_folders_load_in_sentence_transformers(tmp_path):
    """``SentenceTransformer(folder)`` embeds as dpr-gc a shared-tower LoRA decoder folder and a last-token-pooling
    decoder folder (given the EOS that dpr-gc appends); separate LoRA towers it cannot load (its ``Router`` looks for
    each tower's base model in a subfolder of the base), which their card says, and loads once merged."""
    from sentence_transformers import SentenceTransformer

    from dpr_gc.model.lora import merge_lora
    from dpr_gc.model.retriever import RetrieverConfig

    base = save_decoder(tmp_path / "base", "llama", padding_side="right")
    plain = Retriever.load(base)
    plain.save(tmp_path / "plain")
    model = SentenceTransformer(str(tmp_path / "plain"), device="cpu")
    np.testing.assert_allclose(model.encode_query([t + " </s>" for t in TEXTS]), plain.embed("query", TEXTS),
                               atol=1e-5)
    for shared in (True, False):
        retriever = Retriever.from_pretrained(str(base), RetrieverConfig(pooling="mean", shared_encoder=shared))
        apply_lora(retriever, LoraSettings(r=4))
        randomise_adapters(retriever)
        retriever.save(tmp_path / f"lora-{shared}")
        card = (tmp_path / f"lora-{shared}" / "README.md").read_text()
        assert ("cannot load" in card and "dpr-gc merge-lora --model" in card) == (not shared), card
        if not shared:
            merge_lora(retriever)
            retriever.save(tmp_path / f"lora-{shared}")
        model = SentenceTransformer(str(tmp_path / f"lora-{shared}"), device="cpu")
        np.testing.assert_allclose(model.encode_query(TEXTS), retriever.embed("query", TEXTS), atol=1e-5)
        np.testing.assert_allclose(model.encode_document(TEXTS), retriever.embed("passage", TEXTS), atol=1e-5)


def test_lora_flags_that_differ_from_a_saved_adapter_are_refused_and_the_used_ones_recorded(tmp_path):
    """Training a saved LoRA retriever trains its adapter as saved: --lora-* flags with other values are refused in
    one line naming the adapter's settings (an explicit --lora-dropout 0 too), and matching ones, or none, record
    the adapter's (alpha, dropout, targets), so resuming with or without --lora-r goes on."""
    from dpr_gc.model.retriever import RetrieverConfig
    from tests.helpers import call
    from tests.train_data import make_records, write_dpr

    base = save_decoder(tmp_path / "base", "llama", padding_side="left")
    retriever = Retriever.from_pretrained(str(base), RetrieverConfig(pooling="last", passage_format="concat"))
    apply_lora(retriever, LoraSettings(r=4, dropout=0.1, target_modules=["q_proj", "v_proj"]))
    retriever.save(tmp_path / "lora")
    data = write_dpr(tmp_path / "train.json", make_records(8, 1))
    flags = ["train", "--train", data, "--model", tmp_path / "lora", "--batch-size", "4", "--max-steps", "1",
             "--num-workers", "0", "--cache-dir", tmp_path / "c", "--device", "cpu"]
    for given, named in ((["--lora-r", "16"], "--lora-r 16"),
                         (["--lora-r", "4", "--lora-alpha", "32"], "--lora-alpha 32"),
                         (["--lora-r", "4", "--lora-target-modules", "q_proj"], "--lora-target-modules q_proj"),
                         (["--lora-r", "4", "--lora-dropout", "0"], "--lora-dropout 0")):
        code, err = call(main, [*flags, *given, "--output", tmp_path / "x"])
        assert code == 2 and err.count("\n") == 1 and not (tmp_path / "x").exists(), err
        assert "already carries an r=4 adapter (alpha 8, dropout 0.1, on q_proj,v_proj)" in err, err
        assert f"drop {named}, or run dpr-gc merge-lora" in err, err
    saved = {"r": 4, "alpha": 8.0, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}
    for run, given in (("run", ["--lora-r", "4"]), ("plain", [])):
        code, err = call(main, [*flags, *given, "--save-every", "1", "--output", tmp_path / run])
        assert code == 0, err
        recorded = json.loads((tmp_path / run / "train_config.json").read_text())["model"]["lora"]
        assert recorded == saved, recorded
    steps = [*flags[:flags.index("--max-steps") + 1], "2", *flags[flags.index("--max-steps") + 2:]]
    code, err = call(main, [*steps, "--lora-r", "4", "--output", tmp_path / "plain", "--resume",
                            tmp_path / "plain" / "checkpoint-1"])
    assert code == 0, err


def test_the_log_and_the_card_say_the_lora_settings_and_gradient_checkpointing(tmp_path, caplog):
    """The log says the rank, alpha, dropout and targets a run's adapters take (and where the targets came from),
    and that gradient checkpointing is on; the model card of a LoRA folder has a LoRA entry naming its base."""
    import logging

    from tests.helpers import call
    from tests.train_data import make_records, write_dpr

    base = save_decoder(tmp_path / "base", "llama", padding_side="left")
    data = write_dpr(tmp_path / "train.json", make_records(8, 1))
    flags = ["train", "--train", data, "--batch-size", "4", "--max-steps", "1", "--num-workers", "0",
             "--cache-dir", tmp_path / "c", "--device", "cpu"]
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        code, err = call(main, [*flags, "--model", base, "--lora-r", "4", "--lora-dropout", "0.1",
                                "--gradient-checkpointing", "--output", tmp_path / "run"])
    assert code == 0, err
    assert ("LoRA r=4 alpha=8 dropout=0.1 on down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj "
            "(default for llama)") in caplog.text
    assert "gradient checkpointing: activations are recomputed" in caplog.text
    card = (tmp_path / "run" / "final" / "README.md").read_text()
    assert "| lora | r=4 alpha=8 dropout=0.1 on down_proj,gate_proj,k_proj," in card, card
    assert f"LoRA adapters over the base model `{base.resolve()}`" in card, card
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        code, err = call(main, [*flags, "--model", tmp_path / "run" / "final", "--output", tmp_path / "more"])
    assert code == 0 and "LoRA r=4 alpha=8 dropout=0.1 on down_proj," in caplog.text, err
    assert "(the saved adapter)" in caplog.text


def test_a_llama_style_decoder_outside_the_table_gets_the_default_lora_targets():
    """Granite (and any decoder whose blocks hold Llama's q_proj ... down_proj) takes the Llama targets by default."""
    retriever = decoder_retriever("granite")
    apply_lora(retriever, LoraSettings(r=2))
    config = retriever.query_encoder.transformer.peft_config["default"]
    assert set(config.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert adapter_only(retriever)


def test_an_adapter_on_the_embedding_layer_loads_encodes_and_merges(tmp_path, capsys):
    """--lora-target-modules embed_tokens wraps the input embeddings in PEFT's lora.Embedding: the saved retriever
    loads back, encodes as the in-memory one and merges."""
    base = save_decoder(tmp_path / "base", "llama")
    retriever = Retriever.from_pretrained(str(base), decoder_retriever().config)
    apply_lora(retriever, LoraSettings(r=2, target_modules=["embed_tokens", "q_proj"]))
    randomise_adapters(retriever, seed=4)
    with warnings.catch_warnings():  # peft's note that it saves the embedding layer is not the library user's
        warnings.simplefilter("error")
        retriever.save(tmp_path / "lora")
    expected = retriever.embed("query", TEXTS)
    loaded = Retriever.load(tmp_path / "lora")
    np.testing.assert_allclose(loaded.embed("query", TEXTS), expected, rtol=0, atol=1e-6)
    capsys.readouterr()
    assert main(["merge-lora", "--model", str(tmp_path / "lora"), "--output", str(tmp_path / "merged")]) == 0
    merged = Retriever.load(tmp_path / "merged")
    assert not is_adapted(merged.query_encoder.transformer)
    np.testing.assert_allclose(merged.embed("query", TEXTS), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind,targets", [("gpt2", "c_attn,c_proj"), ("llama", "embed_tokens,q_proj")])
def test_peft_advice_stays_out_of_the_command_lines_output(tmp_path, kind, targets):
    """peft's UserWarnings about settings it adjusts itself (GPT-2's Conv1D fan_in_fan_out) appear only with
    --verbose; its note that it saves an adapted embedding layer, never (saving it is the retriever's choice)."""
    from tests.helpers import call
    from tests.llm_models import decoder_tokenizer
    from tests.train_data import make_records, write_dpr

    if kind == "gpt2":
        from transformers import GPT2Config, GPT2Model

        base, tokenizer = tmp_path / "gpt2", decoder_tokenizer()
        torch.manual_seed(0)
        GPT2Model(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=64)
                  ).save_pretrained(base)
        tokenizer.save_pretrained(base)
    else:
        base = save_decoder(tmp_path / "llama", "llama")
    data = write_dpr(tmp_path / "train.json", make_records(8, 1))
    flags = ["train", "--train", data, "--model", base, "--batch-size", "4", "--max-steps", "1", "--num-workers", "0",
             "--cache-dir", tmp_path / "c", "--device", "cpu", "--lora-r", "2", "--lora-target-modules", targets]
    for verbose in ([], ["--verbose"]):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            code, err = call(main, [*verbose, *flags, "--output", tmp_path / f"run{len(verbose)}"])
        assert code == 0, err
        from_peft = [str(w.message) for w in seen if issubclass(w.category, UserWarning) and "peft" in w.filename]
        assert bool(from_peft) == (bool(verbose) and kind == "gpt2"), from_peft


def test_lora_target_names_the_model_lacks_are_refused_naming_its_own_layers():
    """A model type without default targets (GPT-2) is told its own Linear/Conv1D names, not Llama's; a
    --lora-target-modules name matching no module is refused (one line naming it and the flag), even beside one that
    matches."""
    from transformers import GPT2Config, GPT2Model

    from dpr_gc.model.retriever import RetrieverConfig
    from tests.llm_models import decoder_tokenizer

    tokenizer = decoder_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    gpt2 = GPT2Model(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=2, n_head=2, n_positions=64))
    retriever = Retriever(gpt2, None, tokenizer, RetrieverConfig(pooling="last"))
    with pytest.raises(DprGcError) as refused:
        apply_lora(retriever, LoraSettings(r=2))
    line = str(refused.value)
    assert "'gpt2'" in line and "--lora-target-modules" in line and "(e.g. c_attn,c_proj,c_fc)" in line, line
    assert "q_proj" not in line and "\n" not in line, line
    with pytest.raises(DprGcError) as refused:
        apply_lora(decoder_retriever(), LoraSettings(r=2, target_modules=["foo", "q_proj", "bar"]))
    line = str(refused.value)
    assert line.startswith("--lora-target-modules foo, bar: no module of the model is named so"), line
    assert "q_proj" in line and "\n" not in line


@pytest.mark.parametrize("shared", [True, False])
def test_saving_over_a_lora_towers_base_model_folder_is_refused(tmp_path, shared):
    """Retriever.save replaces its folder whole: the folder of a tower's LoRA base model (which the adapter loads),
    or one holding it, is refused as merge-lora's --output is, and left as it was."""
    init = init_model(tmp_path, shared=shared)
    retriever = Retriever.load(init)
    apply_lora(retriever, LoraSettings(r=2))
    retriever.save(tmp_path / "lora")
    base = Path(retriever.query_encoder.transformer.peft_config["default"].base_model_name_or_path)
    assert (base == init) == shared
    for target in sorted({base, init}):
        before = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
        with pytest.raises(DprGcError) as caught:
            retriever.save(target)
        assert "LoRA base model" in str(caught.value) and str(base) in str(caught.value), caught.value
        assert "\n" not in str(caught.value) and sorted(str(p.relative_to(target)) for p in target.rglob("*")) == before
    Retriever.load(tmp_path / "lora")
