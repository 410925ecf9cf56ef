"""Decoder-only encoders (Llama, Qwen2): last-token pooling under left and right padding, the EOS it needs, loading
a decoder folder as a retriever, and Gradient Cache's exact trimming of left-padded chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpr_gc.engine.chunking import Chunking, pad_sequence_dim, trim_padding, trimmed_width
from dpr_gc.model.retriever import Retriever, RetrieverConfig, pool
from tests.helpers import make_batch, random_texts
from tests.llm_models import EOS, QWEN_PAD, TEXTS, cached_step_error, decoder_retriever, decoder_tokenizer, save_decoder

def test_last_pooling_picks_the_last_real_token_under_left_and_right_padding():
    hidden = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert torch.equal(pool(hidden, right, "last", None), torch.stack([hidden[0, 2], hidden[1, 4]]))
    assert torch.equal(pool(hidden, left, "last", None), torch.stack([hidden[0, 4], hidden[1, 4]]))


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_eos_is_appended_within_the_max_length(padding_side):
    retriever = decoder_retriever(padding_side=padding_side, query_max_length=6)
    eos = retriever.tokenizer.eos_token_id
    batch = retriever.tokenize_queries(TEXTS)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    last = ids[torch.arange(len(TEXTS)), (mask * torch.arange(1, ids.size(1) + 1)).argmax(1)]
    assert torch.equal(last, torch.full((len(TEXTS),), eos))
    assert ids.size(1) <= 6 and int(mask.sum(1).max()) == 6  # the long query is cut to make room for EOS
    assert bool((mask[:, 0] == 1).all()) == (padding_side == "right")
    # a tokenizer that ends sequences with EOS itself gets no second one; other poolings get none added
    adds = decoder_tokenizer(padding_side, add_eos=True)
    adds.pad_token = EOS
    own = Retriever(retriever.query_encoder.transformer, None, adds, retriever.config).tokenize_queries(TEXTS[1:2])
    assert own["input_ids"].tolist() == [[adds.bos_token_id, adds.convert_tokens_to_ids("a"), eos]]
    mean = Retriever(retriever.query_encoder.transformer, None, retriever.tokenizer,
                     RetrieverConfig(pooling="mean")).tokenize_queries(TEXTS[1:2])
    assert eos not in mean["input_ids"].tolist()[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_embedding_does_not_depend_on_batch_companions(kind, padding_side):
    """Padded to longer companions, on either side, a text embeds as it does alone (positions follow the mask)."""
    retriever = decoder_retriever(kind, padding_side)
    together = retriever.embed("query", TEXTS)
    alone = np.concatenate([retriever.embed("query", [t]) for t in TEXTS])
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_decoder_folder_loads_as_a_retriever_and_round_trips(tmp_path, kind):
    folder = save_decoder(tmp_path / "base", kind, padding_side="left")
    retriever = Retriever.from_pretrained(str(folder), RetrieverConfig(pooling="last", passage_format="concat",
                                                                       normalize=True))
    assert retriever.tokenizer.pad_token == (EOS if kind == "llama" else QWEN_PAD) and retriever.dim == 32
    expected = retriever.embed("passage", TEXTS, ["paris", "", "london", ""])
    retriever.save(tmp_path / "saved")
    loaded = Retriever.load(tmp_path / "saved")
    assert loaded.config.pooling == "last" and loaded.tokenizer.padding_side == "left"
    np.testing.assert_allclose(loaded.embed("passage", TEXTS, ["paris", "", "london", ""]), expected, atol=1e-6)


def test_trim_cuts_left_padding_and_pads_back_on_the_left():
    left = {"input_ids": torch.tensor([[0, 0, 5, 6], [0, 0, 0, 7]]), "attention_mask": torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]])}
    trim = trimmed_width(left)
    assert trim == (4, 2, "left")
    assert trim_padding(left)["input_ids"].tolist() == [[5, 6], [0, 7]]
    rep = torch.ones(2, 2, 3)
    padded = pad_sequence_dim(rep, trim, token_states=True)
    assert padded[:, :2].abs().sum() == 0 and padded.shape == (2, 4, 3)
    holes = {"input_ids": torch.tensor([[0, 5, 0]]), "attention_mask": torch.tensor([[0, 1, 0]])}
    assert trimmed_width(holes) is None


@pytest.mark.parametrize("kind,shared", [("llama", True), ("qwen2", False)])
@pytest.mark.parametrize("keep_last_graph", [True, False])
def test_cached_step_on_left_padded_decoder_equals_full_batch(kind, shared, keep_last_graph):
    retriever = decoder_retriever(kind, "left", shared=shared)
    q, _ = make_batch(retriever, 8, 1, seed=7)
    assert trimmed_width({k: v[:3] for k, v in q.items()})[2] == "left"
    chunking = Chunking(sort_by_length=True, keep_last_graph=keep_last_graph)
    assert cached_step_error(retriever, 7, chunking=chunking) < 1e-5


def test_training_texts_of_random_lengths_keep_their_eos(tmp_path):
    """Passages longer than the limit still end with EOS after truncation (the state that read the whole text)."""
    retriever = decoder_retriever(padding_side="left", passage_max_length=8)
    batch = retriever.tokenize_passages([""] * 6, random_texts(6, 3, 1, 30))
    assert bool((batch["input_ids"][:, -1] == retriever.tokenizer.eos_token_id).all())
    assert batch["input_ids"].size(1) <= 8


def test_left_padded_absolute_position_model_trims_exactly(tiny_tokenizer):
    """A BERT (absolute position embeddings) fed left-padded batches: positions follow the mask, so trimming a
    chunk's padding columns changes nothing, and a text embeds alike whatever its companions."""
    import copy

    from tests.helpers import tiny_bert

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.padding_side = "left"
    retriever = Retriever(tiny_bert(len(tokenizer)), None, tokenizer, RetrieverConfig(pooling="mean"))
    assert cached_step_error(retriever, 9, chunking=Chunking(sort_by_length=True)) < 1e-5
    np.testing.assert_allclose(retriever.embed("query", TEXTS),
                               np.concatenate([retriever.embed("query", [t]) for t in TEXTS]), atol=1e-5)


class LastToken(torch.nn.Module):
    """A raw GPT-2 (absolute positions, counted from the first column) pooled at the last column: left padding."""

    def __init__(self) -> None:
        from transformers import GPT2Config, GPT2Model

        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT2Model(GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0,
                                        embd_pdrop=0, attn_pdrop=0))
        self.widths: list[int] = []

    def forward(self, input_ids, attention_mask, **kwargs):
        self.widths.append(input_ids.size(1))
        return self.gpt(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state[:, -1]


def left_padded(rows: int, width: int, seed: int, positions: bool) -> dict:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width, (rows,), generator=generator)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    batch = {"input_ids": torch.randint(1, 50, (rows, width), generator=generator) * mask, "attention_mask": mask}
    return batch | ({"position_ids": (mask.cumsum(1) - 1).clamp(min=0)} if positions else {})


@pytest.mark.parametrize("positions", [False, True])
def test_left_padding_is_cut_only_where_positions_do_not_follow_columns(positions):
    """A raw GPT-2 fed left-padded rows without position_ids counts positions from the first column, so cutting a
    chunk's left padding would move every token (the loss went from 4.61 to 9.79): its chunks keep their width and
    the gradient is the full batch's. Given position_ids, they are cut with the chunk, and it is exact too."""
    from dpr_gc import GradCache, SimpleContrastiveLoss

    model, loss_fn = LastToken(), SimpleContrastiveLoss()
    q, p = left_padded(6, 10, 1, positions), left_padded(6, 16, 2, positions)
    expected = loss_fn(model(**q), model(**p))
    expected.backward()
    reference = [t.grad.clone() for t in model.parameters()]
    model.zero_grad()
    model.widths.clear()
    loss = GradCache([model, model], 2, loss_fn, chunking=Chunking(sort_by_length=True, trim=True))(q, p)
    error = max(float((t.grad - r).abs().max() / r.abs().max()) for t, r in zip(model.parameters(), reference))
    assert abs(float(loss) - float(expected.detach())) < 1e-5 and error < 1e-5
    assert (set(model.widths) == {10, 16}) != positions  # the full widths, or some cut


def test_a_retriever_counts_positions_from_the_mask_so_its_left_padding_is_cut():
    retriever = decoder_retriever("llama", "left")
    assert retriever.counts_positions_from_mask
    from dpr_gc.engine.grad_cache import trims_exactly

    q, _ = make_batch(retriever, 8, 1, seed=7)
    assert trims_exactly(retriever, q) and not trims_exactly(retriever.query_encoder.transformer, q)


def test_a_plain_decoder_folder_defaults_to_last_token_pooling_and_refuses_cls(tmp_path, caplog):
    """A plain Llama/Qwen2 folder trains and encodes with last-token pooling and concat passages unless told
    otherwise (cls pooling gives every text of a causal decoder the same vector), logs the pooling it took, and
    refuses an explicit --pooling cls or pooler in one line naming the flag."""
    import json
    import logging

    from dpr_gc.cli import main
    from tests.helpers import call
    from tests.train_data import make_records, write_dpr

    folder = save_decoder(tmp_path / "llama", "llama", padding_side="left")
    train = write_dpr(tmp_path / "train.json", make_records(8, 1))
    flags = ["--train", train, "--batch-size", "4", "--max-steps", "1", "--num-workers", "0", "--cache-dir",
             tmp_path / "c", "--device", "cpu", "--model", folder]
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        code, err = call(main, ["train", *flags, "--output", tmp_path / "run"])
    assert code == 0, err
    saved = json.loads((tmp_path / "run" / "final" / "retriever_config.json").read_text())
    assert (saved["pooling"], saved["passage_format"]) == ("last", "concat")
    assert "a decoder-only llama model: pooling last, passage format concat" in caplog.text
    loaded = Retriever.load(save_decoder(tmp_path / "qwen", "qwen2"))
    assert (loaded.config.pooling, loaded.config.passage_format) == ("last", "concat")
    vectors = loaded.embed("query", TEXTS)
    assert np.abs(vectors - vectors[0]).max() > 1e-3  # the texts do not all embed alike
    for pooling in ("cls", "pooler"):
        code, err = call(main, ["train", *flags, "--pooling", pooling, "--output", tmp_path / pooling])
        assert code == 2 and err.startswith(f"error: --pooling {pooling} does not fit a decoder-only model (llama)")
        assert err.count("\n") == 1 and "--pooling last" in err and not (tmp_path / pooling).exists(), err


def test_a_default_length_beyond_the_models_positions_is_logged_once_and_saved_as_cut(tmp_path, caplog):
    """--passage-max-length's default 256 on a model of 128 positions: texts are cut at 128, the start of training
    says so once, and the saved retriever records 128, so its later loads have no cut to report."""
    import json
    import logging

    from dpr_gc.cli import main
    from tests.helpers import call
    from tests.train_data import make_records, write_dpr

    folder = save_decoder(tmp_path / "llama", "llama", padding_side="left")
    train = write_dpr(tmp_path / "train.json", make_records(8, 1))
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        code, err = call(main, ["train", "--train", train, "--batch-size", "4", "--max-steps", "1", "--num-workers",
                                "0", "--cache-dir", tmp_path / "c", "--device", "cpu", "--model", folder,
                                "--output", tmp_path / "run"])
    assert code == 0, err
    assert caplog.text.count("passage_max_length 256 -> 128") == 1, caplog.text
    saved = json.loads((tmp_path / "run" / "final" / "retriever_config.json").read_text())
    assert (saved["query_max_length"], saved["passage_max_length"]) == (32, 128)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        Retriever.load(tmp_path / "run" / "final")
    assert "exceeds the model's limit" not in caplog.text


def test_a_decoder_family_outside_the_named_ones_takes_last_pooling_and_refuses_cls(tmp_path, caplog):
    """A causal LM type transformers knows but dpr-gc does not name (Granite) is a decoder-only model: it loads with
    last-token pooling, logged, and an explicit --pooling cls is refused in one line."""
    import logging

    from dpr_gc.base.errors import DprGcError

    folder = save_decoder(tmp_path / "granite", "granite")
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        loaded = Retriever.load(folder)
    assert (loaded.config.pooling, loaded.config.passage_format) == ("last", "concat")
    assert "a decoder-only granite model: pooling last, passage format concat" in caplog.text
    vectors = loaded.embed("query", TEXTS)
    assert np.abs(vectors - vectors[0]).max() > 1e-3
    with pytest.raises(DprGcError, match=r"--pooling cls does not fit a decoder-only model \(granite\)"):
        Retriever.from_pretrained(str(folder), RetrieverConfig(pooling="cls"), chosen={"pooling"})


def test_causal_decoders_are_told_from_encoders_and_encoder_decoders():
    """Decoder-only: any causal LM type of transformers that has no masked LM, a config with is_decoder, an
    unknown type whose architectures end in ForCausalLM; never an encoder (even one with a causal LM head class)
    nor an encoder-decoder."""
    from transformers import AutoConfig, PretrainedConfig

    from dpr_gc.model.config import is_causal_decoder

    for model_type in ("granite", "starcoder2", "cohere", "gemma3_text", "smollm3", "llama", "gpt2"):
        assert is_causal_decoder(AutoConfig.for_model(model_type)), model_type
    for model_type in ("bert", "roberta", "electra", "xlm-roberta", "bart", "mbart", "marian", "pegasus", "whisper",
                       "t5", "distilbert", "bert-generation"):
        assert not is_causal_decoder(AutoConfig.for_model(model_type)), model_type
    assert is_causal_decoder(AutoConfig.for_model("bert", is_decoder=True))
    assert is_causal_decoder(PretrainedConfig(architectures=["MyOwnForCausalLM"]))
    assert not is_causal_decoder(PretrainedConfig(architectures=["MyOwnModel"]))
    assert not is_causal_decoder(AutoConfig.for_model("roberta", architectures=["RobertaForCausalLM"]))


def test_a_config_with_is_decoder_takes_last_pooling_and_the_load_logs_it(tmp_path, caplog):
    """docs/stages.md: a plain model whose config has is_decoder (a BERT made causal) defaults to last-token
    pooling, and the pooling taken is logged as the model loads."""
    import logging

    from transformers import BertConfig, BertModel

    from dpr_gc.cli import main
    from tests.helpers import call, passages, write_corpus

    folder = tmp_path / "bert-decoder"
    tokenizer = decoder_tokenizer()
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, is_decoder=True)).save_pretrained(folder)
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        loaded = Retriever.load(folder)
    assert loaded.config.pooling == "last"
    assert "a decoder-only bert model: pooling last" in caplog.text
    caplog.clear()
    corpus = write_corpus(tmp_path / "corpus", passages(4), "tsv")
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        code, err = call(main, ["encode", "--model", folder, "--corpus", corpus, "--output", tmp_path / "emb",
                                "--device", "cpu"])
    assert code == 0, err
    assert "a decoder-only bert model: pooling last" in caplog.text


def test_a_retriever_built_again_quietly_logs_its_recipe_no_second_time(tmp_path, caplog):
    """--fsdp's export builds the retriever again at every save (build_retriever(quiet=True)): the pooling line its
    model's load logs (dpr_gc.model.retriever) is said once, at the start, not again at each export."""
    import logging

    from dpr_gc.train.config import ModelConfig
    from dpr_gc.train.setup import build_retriever

    model = ModelConfig(name=str(save_decoder(tmp_path / "qwen", "qwen2")))
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        build_retriever(model)
        for _ in range(2):
            build_retriever(model, quiet=True)
    assert caplog.text.count("a decoder-only qwen2 model: pooling last") == 1, caplog.text
