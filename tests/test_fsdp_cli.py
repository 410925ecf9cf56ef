"""`dpr-gc train --fsdp` under torchrun (2 gloo ranks, a tiny left-padded Llama with LoRA, Gradient Cache, gradient
checkpointing and a learnable temperature): two
optimizer steps at batch 4 per rank end with the weights of one process at batch 8, a run resumed from its sharded
first checkpoint ends where the uninterrupted one does, dev validation runs on the sharded model with the same
metrics, and final/ and best/ are ordinary retriever folders."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dpr_gc.cli import main
from dpr_gc.model.retriever import Retriever
from dpr_gc.train.config import SETTINGS_FILE
from tests.llm_models import save_decoder
from tests.ranks import run_command
from tests.train_data import make_records, write_dpr

REPO = Path(__file__).resolve().parents[1]


def common_flags(tmp: Path) -> list[str]:
    base = save_decoder(tmp / "base", "llama", padding_side="left")
    data = write_dpr(tmp / "train.json", make_records(16, 1))
    dev = write_dpr(tmp / "dev.json", make_records(8, 2))
    return ["--train", str(data), "--dev", str(dev), "--eval-every", "1", "--model", str(base),
            "--query-chunk-size", "2", "--passage-chunk-size", "3", "--max-steps", "2", "--save-every", "1",
            "--num-workers", "0", "--learning-rate", "1e-2", "--cache-dir", str(tmp / "c"), "--lora-r", "4",
            "--device", "cpu"]


def torchrun(flags: list[str]) -> str:
    """``dpr-gc train`` on 2 ranks, which must succeed; its stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    run = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       "-m", "dpr_gc.cli", "train", *flags], env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stderr


def assert_same_adapter(got_dir: Path, want_dir: Path, what: str) -> None:
    """The trained weights of two final/ folders: LoRA adapters, and the heads (a learnable temperature)."""
    got, want = ({**load_file(str(d / "adapter_model.safetensors")), **load_file(str(d / "heads.safetensors"))}
                 for d in (got_dir, want_dir))
    assert got.keys() == want.keys() and len(got) > 4
    for key in want:
        err = float((got[key] - want[key]).norm() / want[key].norm().clamp(min=1e-12))
        assert err < 1e-4, f"{what}: {key} differs by {err:.2e}"


@pytest.mark.slow  # 48 s in a full run under load 7-10 on 2 cores (2026-11-24)
def test_fsdp_training_through_the_cli_equals_one_process_and_resumes(tmp_path, capsys):
    flags = [*common_flags(tmp_path), "--gradient-checkpointing", "--learn-temperature"]
    assert main(["train", *flags, "--batch-size", "8", "--output", str(tmp_path / "single")]) == 0
    log = torchrun([*flags, "--batch-size", "4", "--fsdp", "--output", str(tmp_path / "fsdp")])
    for line in ("train.json: 16 records", "dev before training:", "LoRA: ", "training 2 steps",
                 "a decoder-only llama model: pooling last, passage format concat"):
        assert log.count(line) == 1, (line, log[-3000:])  # rank 1 logs warnings and errors only; not at each save
    single, sharded = tmp_path / "single" / "final", tmp_path / "fsdp" / "final"
    assert_same_adapter(sharded, single, "2 ranks x 4 vs 1 x 8")
    dev = [{k: v for k, v in json.loads(line).items() if k.startswith("dev_")}
           for run in ("single", "fsdp") for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert len(dev) == 6 and all(dev[:3])  # steps 0, 1, 2 of each run
    losses = [[json.loads(line).get("loss") for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
              for run in ("single", "fsdp")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4), losses  # the logged loss is the global batch's
    for want, got in zip(dev[:3], dev[3:]):
        assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-4) for k in want), (got, want)
    assert_same_adapter(tmp_path / "fsdp" / "best", tmp_path / "single" / "best", "best/")
    checkpoint = tmp_path / "fsdp" / "checkpoint-1"
    assert (checkpoint / "sharded" / ".metadata").is_file() and not (checkpoint / "model").exists()

    log = torchrun([*flags, "--batch-size", "4", "--fsdp", "--output", str(tmp_path / "fsdp"), "--resume",
                    str(checkpoint)])
    assert log.count("resumed from step 1") == 1, log[-3000:]
    assert_same_adapter(sharded, single, "resumed from the sharded checkpoint")
    # a sharded checkpoint resumes only with --fsdp, a plain one only without, each refused in a line naming it
    # (the run's settings record names the change; without a record the checkpoint's own layout does), before the
    # ranks are checked: one process refuses as each rank of a torchrun launch would
    resumes = {"True -> False": [*flags, "--batch-size", "4", "--output", str(tmp_path / "fsdp"), "--resume",
                                 str(checkpoint)],
               "False -> True": [*flags, "--batch-size", "8", "--fsdp", "--output", str(tmp_path / "single"),
                                 "--resume", str(tmp_path / "single" / "checkpoint-1")]}
    for change, argv in resumes.items():
        assert main(["train", *argv]) == 2
        assert f"--fsdp {change}" in capsys.readouterr().err.strip().splitlines()[-1]
    for run in ("fsdp", "single"):
        (tmp_path / run / SETTINGS_FILE).unlink()
        (tmp_path / run / "checkpoint-1" / SETTINGS_FILE).unlink()
    for written, argv in zip(("with", "without"), resumes.values()):
        assert main(["train", *argv]) == 2
        assert f"this checkpoint was written {written} --fsdp; resume it the same way" in capsys.readouterr().err
    texts = ["a question about rivers", "paris is a city"]
    got, want = (Retriever.load(d).embed("passage", texts) for d in (sharded, single))
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=0, atol=1e-4)


@pytest.mark.slow  # 26 s in a full run under load 7-10 on 2 cores (2026-11-24)
def test_fsdp_plain_training_equals_one_process(tmp_path):
    flags = [*common_flags(tmp_path), "--no-grad-cache"]
    for chunk in ("--query-chunk-size", "--passage-chunk-size"):  # plain training refuses them (it would ignore them)
        at = flags.index(chunk)
        del flags[at:at + 2]
    assert main(["train", *flags, "--batch-size", "8", "--output", str(tmp_path / "single")]) == 0
    torchrun([*flags, "--batch-size", "4", "--fsdp", "--output", str(tmp_path / "fsdp")])
    assert_same_adapter(tmp_path / "fsdp" / "final", tmp_path / "single" / "final", "plain training")


@pytest.mark.slow  # ~20 s on 2 idle cores (2026-11-28)
def test_fsdp_trains_in_bf16_with_bf16_parameters_and_fp32_weights_saved(tmp_path):
    """docs/distributed.md: under ``--precision bf16`` FSDP holds bf16 parameters and reduces gradients in fp32. Its
    run says so, its first loss (before any update) is the one-process bf16 run's within bf16 rounding, and final/
    holds fp32 adapters whose first AdamW step (LoRA B starts at zero) goes the way that run's does."""
    flags = [*common_flags(tmp_path), "--precision", "bf16", "--max-steps", "1", "--learning-rate", "1e-3"]
    assert main(["train", *flags, "--batch-size", "8", "--output", str(tmp_path / "single")]) == 0
    log = torchrun([*flags, "--batch-size", "4", "--fsdp", "--output", str(tmp_path / "fsdp")])
    assert log.count("bf16 parameters, fp32 gradient reduction (FSDP2)") >= 1, log[-3000:]
    losses = [json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
              for run in ("single", "fsdp")]
    assert losses[1] == pytest.approx(losses[0], rel=2e-2), losses
    got, want = (load_file(str(tmp_path / run / "final" / "adapter_model.safetensors")) for run in ("fsdp", "single"))
    assert got.keys() == want.keys() and all(t.dtype == torch.float32 for t in got.values())
    moved = [key for key in want if key.endswith("lora_B.weight")]  # zero at the start: one AdamW step's signs
    agree = sum(int((got[k].sign() == want[k].sign()).sum()) for k in moved) / sum(want[k].numel() for k in moved)
    assert moved and agree > 0.9, agree  # a step in bf16 rounding flips the signs of the smallest gradients only


def test_fsdp_settings_are_refused_with_one_line(tmp_path, capsys):
    flags = common_flags(tmp_path)
    out = ["--batch-size", "4", "--output", str(tmp_path / "x")]
    assert main(["train", *flags, *out, "--fsdp-cpu-offload"]) == 2
    assert "--fsdp-cpu-offload needs --fsdp" in capsys.readouterr().err
    assert main(["train", *flags, *out, "--fsdp", "--precision", "fp16"]) == 2
    assert "--fsdp trains in --precision fp32 or bf16" in capsys.readouterr().err
    assert main(["train", *flags, *out, "--fsdp"]) == 2
    assert "launch with torchrun" in capsys.readouterr().err
    # checked before the ranks are, so one process shows what every rank of a torchrun launch says
    assert main(["train", *flags, *out, "--fsdp", "--fsdp-cpu-offload"]) == 2
    assert "error: --fsdp-cpu-offload moves GPU weights to the CPU" in capsys.readouterr().err


def test_fsdp_environment_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """--fsdp without torchrun and --fsdp-cpu-offload on the CPU were refused only once the model had loaded and the
    data been parsed (minutes for an LLM); they depend on the launch and the device alone."""
    from dpr_gc.train.trainer import Trainer

    monkeypatch.setattr(Trainer, "build_model", lambda self: pytest.fail("the model loaded first"))
    flags = [*common_flags(tmp_path), "--batch-size", "4", "--output", str(tmp_path / "x")]
    assert main(["train", *flags, "--fsdp"]) == 2
    assert "launch with torchrun" in capsys.readouterr().err
    assert main(["train", *flags, "--fsdp", "--fsdp-cpu-offload"]) == 2
    assert "error: --fsdp-cpu-offload moves GPU weights to the CPU" in capsys.readouterr().err


@pytest.mark.parametrize("fsdp,precision,world,ranks,means", [
    (True, "bf16", 2, "FSDP2 over 2 ranks (the model sharded)", "bf16 parameters, fp32 gradient reduction (FSDP2)"),
    (True, "fp32", 8, "FSDP2 over 8 ranks (the model sharded)", "fp32"),
    (False, "bf16", 2, "DDP over 2 ranks", "bf16"), (False, "fp32", 1, "one process", "fp32")])
def test_the_summary_names_fsdp_and_what_its_precision_means(fsdp, precision, world, ranks, means):
    """The start line and the summary read the same under --fsdp as under DDP, though FSDP's bf16 is bf16
    parameters (MixedPrecisionPolicy), not autocast over fp32 ones."""
    from dpr_gc.train.report import describe_parallel, describe_precision, summary_table
    from tests.helpers import summary_rows

    assert (describe_parallel(fsdp, world), describe_precision(fsdp, precision)) == (ranks, means)
    summary = {"steps": 2, "effective_batch": 8, "passages_per_query": 2, "chunk_sizes": [2, 3], "precision": precision,
               "parallel": ranks, "fsdp": fsdp, "device": "cpu", "final_loss": 1.0, "examples_per_s": 3.0,
               "best": None, "best_metric": "avg_rank", "final_model": "out/final", "seconds": 1.0}
    rows = summary_rows(summary_table(summary))
    assert (rows["ranks"], rows["precision"]) == (ranks, means)
