"""`dpr-gc verify`: the cached step against the full-batch step on the user's own settings. Passes on every
supported set-up (tiny models), fails with the worst tensor named for a model whose noise GradCache cannot replay,
falls back to a smaller batch when the full one runs out of memory, and writes nothing to --output."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

from transformers import BertTokenizerFast

from dpr_gc.cli import main
from dpr_gc.model.retriever import Retriever, RetrieverConfig
from dpr_gc.train.config import TrainConfig
from dpr_gc.train.trainer import Trainer
from dpr_gc.train.verify import Verifier, verify
from tests.helpers import summary_rows, tiny_bert, write_vocab
from tests.llm_models import save_decoder
from tests.train_data import init_model
from tests.train_data import make_records, task_config, train_config, write_dpr


def flags(tmp, model, *extra: str) -> list[str]:
    data = tmp / "train.json"
    if not data.exists():
        write_dpr(data, make_records(24, 1))
    return ["verify", "--train", str(data), "--output", str(tmp / "out"), "--model", str(model), "--batch-size", "6",
            "--query-chunk-size", "2", "--passage-chunk-size", "4", "--num-workers", "0", "--cache-dir",
            str(tmp / "cache"), "--device", "cpu", *extra]


def run(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().out


def test_passes_shared_towers_hard_negatives_learned_temperature(tmp_path, capsys):
    model = init_model(tmp_path, learn_temperature=True, temperature=0.3)
    code, out = run(capsys, flags(tmp_path, model, "--hard-negatives", "2"))
    assert code == 0 and "PASS" in out, out
    assert "tolerance 1e-05" in out and "temperature grad" in out and "one forward per side" in out
    table, _, rest = out.partition("|\n\n")  # each table ends at a blank line: the verdict and summary apart
    assert rest.startswith("PASS: ") and "PASS: the cached step equals" in rest.split("\n\n")[0], out
    assert "\n\n| item | value |" in rest, out
    assert not (tmp_path / "out").exists(), "verify must not write to --output"
    assert main(flags(tmp_path, model, "--batches", "0")) == 2
    assert main(flags(tmp_path, model, "--no-grad-cache")) == 2
    assert "drop --no-grad-cache" in capsys.readouterr().err


def test_verify_needs_no_output_folder(tmp_path, capsys):
    """Verify writes nothing, so --output (kept for a train command line run as it is) is not required."""
    model = init_model(tmp_path)
    argv = flags(tmp_path, model)
    at = argv.index("--output")
    code, out = run(capsys, argv[:at] + argv[at + 2:])
    assert code == 0 and "PASS" in out, out


def test_a_train_command_lines_dev_flags_are_accepted_and_the_dev_file_left_unread(tmp_path, capsys, monkeypatch):
    """verify loaded and tokenised the --dev file of a train command line though it runs no validation."""
    from dpr_gc.train import trainer

    read = []
    monkeypatch.setattr(trainer, "load_dev_data", lambda *args: read.append(args))
    dev = tmp_path / "dev.json"
    write_dpr(dev, make_records(4, 1))
    code = main(flags(tmp_path, init_model(tmp_path), "--dev", str(dev), "--eval-every", "1"))
    out, err = capsys.readouterr()
    assert code == 0 and "PASS" in out and read == [], out + err


def test_the_training_runs_warm_up_is_not_announced_as_the_checks(tmp_path, capsys, caplog):
    """It logged "--warmup-ratio 0.1 of 1 step: 1 warm-up step" for a training run of many steps."""
    import logging

    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        code, out = run(capsys, flags(tmp_path, init_model(tmp_path), "--warmup-ratio", "0.1", "--epochs", "2"))
    assert code == 0 and "PASS" in out, out
    assert "--warmup-ratio" not in caplog.text and "warm-up step" not in caplog.text
    assert "--max-steps" not in caplog.text  # verify's own few steps are not the run's length


def test_table_names_the_device_and_what_the_memory_budget_kept(tmp_path, capsys):
    """The chunking's budget is a choice (auto: resolved from the free memory): the table says where it ran and,
    for each batch, how many graphs the cached step kept under how many bytes (only the chunking was named)."""
    model = init_model(tmp_path)
    code, out = run(capsys, flags(tmp_path, model, "--memory-budget", "1GB", "--hard-negatives", "1"))
    assert code == 0 and out.startswith("verify on cpu: batch 6 per rank"), out
    assert "| graphs kept (budget) |" in out and "| 6/6 chunks, 100% of tokens (budget 1.00 GB) |" in out, out
    assert (summary_rows(out)["result"], summary_rows(out)["device"]) == ("PASS", "cpu")
    code, out = run(capsys, flags(tmp_path, model, "--hard-negatives", "1"))  # budget 0: only the last chunk's
    assert code == 0 and re.search(r"\| 1/6 chunks, \d+% of tokens \(budget 0 B\) \|", out), out


def cls_model(tmp) -> str:
    """Separate towers with CLS pooling and dropout, weights drawn wide: a random BERT's CLS vector barely depends
    on its input otherwise, and the gradient would be rounding."""
    tokenizer = BertTokenizerFast(vocab=str(write_vocab(tmp / "vocab.txt")))
    towers = [tiny_bert(len(tokenizer), seed, dropout=0.1) for seed in (0, 1)]
    with torch.no_grad():
        for param in (p for t in towers for p in t.parameters() if p.dim() == 2):
            param.normal_(0, 0.2)
    config = RetrieverConfig(pooling="cls", shared_encoder=False, query_max_length=16, passage_max_length=32)
    Retriever(*towers, tokenizer, config).save(tmp / "cls")
    return tmp / "cls"


@pytest.mark.slow  # 22 s in a full run under load 7-10 on 2 cores (2026-11-24)
def test_passes_separate_towers_cls_dropout_budget_two_batches(tmp_path, capsys):
    model = cls_model(tmp_path)
    code, out = run(capsys, flags(tmp_path, model, "--memory-budget", "1GB", "--batches", "2"))
    assert code == 0 and "PASS" in out and "chunk by chunk" in out, out
    # Against the chunk-ordered reference a zero-in-exact-arithmetic gradient is not reported as the worst (the
    # dropout-0 rows compare training's chunks with the whole batch, rounded apart, as for a model without dropout).
    chunk_ordered = [line for line in out.splitlines() if re.match(r"\| [12] \|", line)]
    assert len(chunk_ordered) == 2 and not any("key.bias" in line for line in chunk_ordered), out
    assert out.count("| 6 |") == 4 and "| 2 (dropout 0) | 6 |" in out, out
    assert "dropout 0: one graph, one forward" in out, out
    assert summary_rows(out)["batches checked"] == "2", out


def test_passes_lora_checkpointing_bf16(tmp_path, capsys):
    model = init_model(tmp_path)
    code, out = run(capsys, flags(tmp_path, model, "--lora-r", "4", "--gradient-checkpointing", "--precision", "bf16"))
    assert code == 0 and "PASS" in out and "bf16 (tolerance 0.02)" in out, out


def test_fp16_is_checked_at_its_own_tolerance(tmp_path, capsys):
    """docs/training.md: fp16 autocast is compared within 5e-3 (fp32 1e-5, bf16 2e-2)."""
    code, out = run(capsys, flags(tmp_path, init_model(tmp_path), "--precision", "fp16"))
    assert code == 0 and "PASS" in out and "fp16 (tolerance 0.005)" in out, out


def test_fp16_gradients_that_overflow_at_the_first_loss_scale_are_compared_at_a_lower_one(tmp_path, capsys):
    """At temperature 0.05 both steps' gradients overflow at GradScaler's first scale (65536), which training skips;
    verify lowers the scale as the scaler does and compares there, naming the scale it ran at."""
    model = init_model(tmp_path, temperature=0.05)
    code, out = run(capsys, flags(tmp_path, model, "--precision", "fp16", "--hard-negatives", "1"))
    assert code == 0 and "PASS" in out and "nan" not in out, out
    assert re.search(r"overflow at loss scale 65536; compared at loss scale \d+", out), out


def test_passes_decoder_last_pooling_token_chunks(tmp_path, capsys):
    base = save_decoder(tmp_path / "base", "llama", padding_side="left")
    code, out = run(capsys, flags(tmp_path, base, "--pooling", "last", "--passage-format", "concat",
                                  "--passage-chunk-tokens", "40"))
    assert code == 0 and "PASS" in out and "passage chunks of 4 rows / 40 tokens" in out, out


class Noise(nn.Module):
    """Test-only: adds noise from a generator the model owns, which GradCache cannot record or replay."""

    def __init__(self, amplitude: float = 0.5) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(0)
        self.amplitude = amplitude

    def forward(self, module, args, output):
        hidden = output.last_hidden_state
        noise = 1 + (torch.rand(hidden.shape, generator=self.generator) - 0.5) * self.amplitude
        output.last_hidden_state = hidden * noise
        return output


def hook_the_query_encoder(monkeypatch: pytest.MonkeyPatch, hook: Callable) -> None:
    """Every model verify builds runs ``hook`` after its query encoder's transformer (noise, overflow)."""
    build = Trainer.build_model

    def hooked(self):
        retriever = build(self)
        retriever.query_encoder.transformer.register_forward_hook(hook)
        return retriever

    monkeypatch.setattr(Trainer, "build_model", hooked)


def test_fails_on_noise_it_cannot_replay(tmp_path, capsys, monkeypatch):
    model = init_model(tmp_path)
    hook_the_query_encoder(monkeypatch, Noise())
    code, out = run(capsys, flags(tmp_path, model))
    assert code == 1 and "FAIL" in out and "worst tensor query_encoder.transformer." in out, out


def test_an_fp32_gap_that_float64_closes_passes_as_rounding_and_one_it_keeps_fails(tmp_path, capsys, monkeypatch):
    """Past the fp32 tolerance (here made 1e-11, below fp32's rounding), verify re-runs both steps with the towers
    in float64: they agree there, so the batch passes with a note (and fails, its note saying float64 closes the gap,
    where the gap is past FP32_ROUNDING_LIMIT); a small defect (noise the cache cannot replay, 1e-5 of the hidden
    states) is still a gap in float64 and fails."""
    import dpr_gc.train.verify as verify_module

    model = init_model(tmp_path, learn_temperature=True, temperature=0.3)
    monkeypatch.setitem(verify_module.TOLERANCES, "fp32", 1e-11)
    code, out = run(capsys, flags(tmp_path, model, "--hard-negatives", "1"))
    gap = re.search(r"differ by (\S+) in fp32 and by (\S+) with the towers in float64", out)
    assert code == 0 and "PASS" in out and gap and "fp32 rounding: the steps differ" in out, out
    assert 1e-11 < float(gap.group(1)) < 1e-4 and float(gap.group(2)) < 1e-11, out
    monkeypatch.setattr(verify_module, "FP32_ROUNDING_LIMIT", 1e-11)  # the same gap, past what rounding explains
    code, out = run(capsys, flags(tmp_path, model, "--hard-negatives", "1"))
    assert code == 1 and "FAIL" in out and "float64 closes it, but past the 1e-11 fp32 rounding can explain" in out, out
    hook_the_query_encoder(monkeypatch, Noise(amplitude=1e-5))
    code, out = run(capsys, flags(tmp_path, model, "--hard-negatives", "1"))
    gap = re.search(r"differ by (\S+) in fp32 and by (\S+) with the towers in float64", out)
    assert code == 1 and "FAIL" in out and gap and float(gap.group(2)) > 1e-9, out
    assert "not rounding: the steps differ" in out, out


def test_library_call_and_out_of_memory_fallback(tmp_path, monkeypatch):
    model = init_model(tmp_path)
    data = write_dpr(tmp_path / "train.json", make_records(24, 1))
    config = train_config(train_files=[str(data)], output_dir=str(tmp_path / "out"), model=str(model), batch_size=8,
                          query_chunk_size=3, passage_chunk_size=5, num_workers=0, cache_dir=str(tmp_path / "c"))
    full_step = Verifier.full_step

    def small_memory(self, query, passage, ids):
        if query["input_ids"].size(0) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return full_step(self, query, passage, ids)

    monkeypatch.setattr(Verifier, "full_step", small_memory)
    report = verify(config)
    assert report.passed and report.batches[0].queries == 4
    assert "the full batch of 8 queries needs more than" in report.batches[0].note
    assert "verified on 4 queries with the same chunking" in report.table()
    assert report.batches[0].cached.peak_bytes > 0 and report.batches[0].full.peak_bytes > 0
    assert not (tmp_path / "out").exists()


def test_batches_past_one_epoch_are_the_next_epochs_as_training_draws_them(tmp_path, monkeypatch):
    """``--batches N`` past an epoch (24 questions, batch 8: 3 a epoch) checks N batches, the later ones drawn from
    the next epoch with the trainer's per-epoch seeding (it checked one epoch and passed)."""
    import dpr_gc.train.verify as verify_module

    model = init_model(tmp_path)
    data = write_dpr(tmp_path / "train.json", make_records(24, 1))
    config = train_config(train_files=[str(data)], output_dir=str(tmp_path / "out"), model=str(model), batch_size=8,
                          query_chunk_size=4, passage_chunk_size=8, num_workers=0, cache_dir=str(tmp_path / "c"),
                          hard_negatives=1)
    checked, check_batch = [], verify_module.check_batch

    def recording(verifier, query, passage, ids, tolerance):
        checked.append((query["input_ids"].clone(), passage["input_ids"].clone()))
        return check_batch(verifier, query, passage, ids, tolerance)

    monkeypatch.setattr(verify_module, "check_batch", recording)
    report = verify(config, batches=5)
    assert report.passed and len(report.batches) == 5 and len(checked) == 5
    trainer = Trainer(config)
    drawn = []
    for epoch in (0, 1):
        trainer.sampler.set_epoch(epoch)
        drawn += [(b["query"]["input_ids"], b["passage"]["input_ids"]) for b in trainer.loader]
    assert len(drawn) == 6
    for (query, passage), (want_query, want_passage) in zip(checked, drawn):
        assert torch.equal(query, want_query) and torch.equal(passage, want_passage)
    assert not torch.equal(checked[3][0], checked[0][0])  # epoch 1 is reshuffled, not epoch 0 again


def shared_positives(path, groups: int = 3):
    """Training data whose questions share positives (``groups`` passages, by id): duplicate positives in a batch."""
    records = make_records(24, 1)
    for i, record in enumerate(records):
        g = i % groups
        record["positive_ctxs"] = [{"title": f"shared {g}", "text": f"shared positive passage {g} paris river",
                                    "passage_id": f"P{g}"}]
    return write_dpr(path, records)


def test_verify_checks_the_masked_loss_training_uses(tmp_path, capsys):
    """Training drops a query's duplicate positives from its negatives by default; verify checked the unmasked loss
    (it passed no passage ids) and ignored --no-mask-duplicate-positives. Its loss is now the one train's first step
    logs, and the flag switches it to DPR's unmasked loss."""
    model = init_model(tmp_path)
    shared_positives(tmp_path / "train.json")
    argv = flags(tmp_path, model, "--hard-negatives", "1")
    code, err = call_train(capsys, ["train", *argv[1:], "--max-steps", "1"])
    assert code == 0, err
    logged = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert logged["masked_scores"] > 0, logged
    losses = {}
    for extra in ((), ("--no-mask-duplicate-positives",)):
        code, out = run(capsys, argv + list(extra))
        cached, full = re.search(r"\| 1 \| 6 \| (\S+) / (\S+) \|", out).groups()
        assert code == 0 and "PASS" in out and cached == full, out
        losses[extra] = float(cached)
    assert abs(losses[()] - logged["loss"]) < 1e-6, (losses, logged)
    assert abs(losses[("--no-mask-duplicate-positives",)] - logged["loss"]) > 1e-3, (losses, logged)


def call_train(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def test_resume_is_refused_not_silently_ignored(tmp_path, capsys):
    """verify takes train's flags but checks the starting model: --resume latest checked it silently."""
    model = init_model(tmp_path)
    capsys.readouterr()  # saving the model drew a progress bar
    assert main(flags(tmp_path, model, "--resume", "latest")) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --resume latest does not apply to verify: it checks the starting model; to check a "
                   "checkpoint's weights, give its model/ folder as --model"), err


def cancelling_temperature(tmp: Path) -> TrainConfig:
    """A LoRA decoder at temperature 0.199 whose second batch's temperature gradient nearly cancels (2.4e-4 against
    0.76 on the first), so fp32 rounding of its terms is a large share of it."""
    from dpr_gc.model.lora import LoraSettings

    save_decoder(tmp / "decoder", "llama", padding_side="left")
    data = write_dpr(tmp / "train.json", make_records(16, 1))
    retriever = RetrieverConfig(pooling="last", passage_format="concat", learn_temperature=True, temperature=0.199)
    return train_config(train_files=[str(data)], output_dir=str(tmp / "out"), model=str(tmp / "decoder"),
                        retriever=retriever, lora=LoraSettings(r=4), batch_size=8, query_chunk_size=3,
                        passage_chunk_size=3, num_workers=0, cache_dir=str(tmp / "cache"), device="cpu")


def test_a_temperature_gradient_that_nearly_cancels_passes_and_a_wrong_one_fails(tmp_path, monkeypatch):
    """The temperature's gradient sums terms of both signs; its error is measured against their absolute sum, so
    where they nearly cancel the fp32 rounding of the terms passes (relative to the sum alone it was 3.6e-3), while a
    cached temperature gradient twice the full one fails."""
    config = cancelling_temperature(tmp_path)
    report = verify(config, batches=2)
    first, second = (b.temperature_grad[1] for b in report.batches)
    assert abs(second) < 1e-3 * abs(first), report.table()
    assert report.passed and "PASS" in report.table(), report.table()
    assert all(b.temperature_error < 1e-5 for b in report.batches), report.table()
    cached_step = Verifier.cached_step

    def doubled_temperature(self, query, passage, ids):
        loss, grads, cost = cached_step(self, query, passage, ids)
        grads["tau.log_value"] = grads["tau.log_value"] * 2
        return loss, grads, cost

    monkeypatch.setattr(Verifier, "cached_step", doubled_temperature)
    report = verify(config, batches=2)
    first = report.batches[0]
    assert not report.passed and first.temperature_error > 1e-3 and "not rounding" in first.note, report.table()
    assert "FAIL" in report.table() and "worst tensor tau.log_value" in report.table(), report.table()


def centred_over_the_batch(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
    return out - out.mean(0, keepdim=True)  # batch statistics, as BatchNorm in train mode


def shifted_by_the_padded_width(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
    return out + 0.01 * out.shape[1]  # depends on the padded width, which the cached step trims


@pytest.mark.parametrize("budget", ["300KB", "1GB"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("layer", [centred_over_the_batch, shifted_by_the_padded_width])
def test_fails_a_model_whose_output_depends_on_the_batch_or_its_padding(tmp_path, dropout, layer, budget):
    """verify.py: the full batch runs in one forward per side, so a layer using batch statistics or the padded
    width, which no chunked step can reproduce, fails (a correct model passes alongside). With dropout, the
    dropout-0 check runs the chunks training's first step runs (not those the first check's measurements would
    join: under a budget holding the whole batch, one chunk per side, which proves nothing)."""
    train = write_dpr(tmp_path / "train.json", make_records(32, 2, hard=1))
    task = {"train": train, "model": init_model(tmp_path, dropout=dropout), "dir": tmp_path}

    def embeddings_through(hook):
        return lambda t: t.retriever.query_encoder.transformer.embeddings.register_forward_hook(hook)

    for hook, passes in ((layer, False), (lambda module, inputs, out: out, True)):
        config = task_config(task, tmp_path / "out", batch_size=8, memory_budget=budget)
        report = verify(config, 1, hook=embeddings_through(hook))
        assert report.passed is passes, report.table()
        chunks = [check.memory.chunks for check in report.batches]
        assert chunks == [chunks[0]] * (2 if dropout else 1), report.table()


def test_the_bound_is_on_the_whole_gradient_in_the_verdict_as_in_its_float64_re_check(tmp_path, monkeypatch):
    """The tolerance bounds the loss, the overall gradient and the temperature's, the worst tensor being shown to
    locate a gap (docs/training.md): a tensor whose exact gradient is near zero holds only rounding (an attention key
    bias, 2.8e-2 in bf16 on all-MiniLM-L6-v2 at batch 32). The float64 re-check judged the worst tensor too, so an fp32
    gap that float64 closes over the whole gradient failed as 'not rounding' on one tensor's rounding."""
    model = init_model(tmp_path)
    data = write_dpr(tmp_path / "train.json", make_records(24, 1))
    config = train_config(train_files=[str(data)], output_dir=str(tmp_path / "out"), model=str(model), batch_size=6,
                          query_chunk_size=2, passage_chunk_size=4, num_workers=0, cache_dir=str(tmp_path / "c"))
    cached_step, off = Verifier.cached_step, "query_encoder.transformer.embeddings.LayerNorm.bias"

    def rounded(self, query, passage, ids):  # fp32: the whole gradient 2e-5 off; float64: one tensor 3e-5 off
        loss, grads, cost = cached_step(self, query, passage, ids)
        if grads[off].dtype == torch.float64:
            grads[off] = grads[off] * (1 + 3e-5)
        else:
            grads = {name: grad * (1 + 2e-5) for name, grad in grads.items()}
        return loss, grads, cost

    monkeypatch.setattr(Verifier, "cached_step", rounded)
    report = verify(config)
    for check in report.batches:
        assert 1e-5 < check.grad_error < 3e-5 and check.float64_error is not None, report.table()
        assert check.float64_error < 1e-6 and "fp32 rounding" in check.note, report.table()
    assert report.passed, report.table()


def test_fp16_gradients_not_finite_at_any_loss_scale_fail_saying_so(tmp_path, capsys, monkeypatch):
    """Hidden states scaled past fp16's range overflow in the step itself: no loss scale makes the gradients finite.
    After SCALE_TRIES halvings verify fails in one line saying they are not finite and down to which scale (it said
    'differs beyond 0.005' with a NaN gradient error and the scale it gave up at as 'compared at')."""
    hook_the_query_encoder(monkeypatch, Overflowing())
    code, out = run(capsys, flags(tmp_path, init_model(tmp_path), "--precision", "fp16"))
    verdict = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert code == 1 and verdict == [
        "FAIL: batch 1: the gradients are not finite (inf/NaN) at loss scale 65536 nor after 24 halvings down to "
        "0.00390625: the fp16 step overflows whatever its loss scale (training would skip every step until it stops "
        "the run as diverged); try --precision bf16 or fp32"], out
    assert "compared at" not in out and "nan" not in out.lower().replace("inf/nan", ""), out
    monkeypatch.setattr(Overflowing, "factor", 1e38)  # past fp32's range too: no loss scale to lower there
    code, out = run(capsys, flags(tmp_path, init_model(tmp_path), "--precision", "fp32"))
    assert code == 1 and "FAIL: batch 1: the gradients are not finite (inf/NaN) in fp32: the step itself overflows " \
        "(training stops at such a step as diverged)" in out, out


class Overflowing:
    """Test-only forward hook: hidden states times ``factor``, past fp16's 65504 in the loss's products."""

    factor = 1e5

    def __call__(self, module: nn.Module, inputs: tuple, output):
        output.last_hidden_state = output.last_hidden_state * self.factor
        return output


def test_every_precision_checks_the_same_batches_from_the_same_random_state(tmp_path, monkeypatch):
    """With dropout, over two batches: fp32, bf16 and fp16 (whose first scale overflows at temperature 0.05, so its
    steps run again at lower scales) start every step of every check from one random state, on the same batches."""
    import dpr_gc.train.verify as verify_module

    model = init_model(tmp_path, dropout=0.1, temperature=0.05)
    data = write_dpr(tmp_path / "train.json", make_records(24, 1))
    both_steps, seen = verify_module.both_steps, {}

    def recording(verifier, query, passage, ids):
        seen[precision].append((torch.get_rng_state(), query["input_ids"].clone(), passage["input_ids"].clone()))
        return both_steps(verifier, query, passage, ids)

    monkeypatch.setattr(verify_module, "both_steps", recording)
    for precision in ("fp32", "bf16", "fp16"):
        seen[precision] = []
        config = train_config(train_files=[str(data)], output_dir=str(tmp_path / "out"), model=str(model),
                              batch_size=6, query_chunk_size=2, passage_chunk_size=4, num_workers=0, hard_negatives=1,
                              cache_dir=str(tmp_path / "c"), precision=precision)
        report = verify(config, batches=2)
        assert report.passed and len(report.batches) == 4, report.table()
    assert len(seen["fp16"]) > len(seen["fp32"]) == len(seen["bf16"]) == 4  # fp16 ran its steps again
    state = seen["fp32"][0][0]
    assert all(torch.equal(rng, state) for steps in seen.values() for rng, _, _ in steps)
    batches = {p: distinct([(q, d) for _, q, d in steps]) for p, steps in seen.items()}
    assert len(batches["fp32"]) == 2 and all(len(b) == 2 for b in batches.values()), batches
    for (q, d), (q2, d2) in zip(batches["fp32"] * 2, batches["bf16"] + batches["fp16"]):
        assert torch.equal(q, q2) and torch.equal(d, d2)


def distinct(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``batches`` without a repeat of the one before (a batch's checks and fp16's runs again at lower scales)."""
    return [b for i, b in enumerate(batches) if i == 0 or not torch.equal(b[0], batches[i - 1][0])]
