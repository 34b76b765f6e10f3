"""The training-run recorder (`grpo_core.recorder`) and the comparison of two recorded runs (`harness/training.py`):
keys, the run table, its checks, and the diff's attribution on runs made here with the fused linear loss (no trainer:
`tests/test_trl_record.py` records TRL runs)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from conftest import DEVICES
from grpo_core.digest import mantissas, row_digests
from grpo_core.linear import LinearGRPOLossOp, linear_grpo_loss
from grpo_core.recorder import TrainingRecorder, sequence_keys
from harness.record import TableError
from harness.scenarios import RegroupedLinearOp
from harness.training import format_moved, read_training_run, sequence_verdicts, training_comparison, verdict_text

ROOT = Path(__file__).resolve().parents[1]


def test_sequence_keys_read_the_active_tokens_only():
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 9]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    prompt, pmask = torch.tensor([[0, 3], [0, 3]]), torch.tensor([[0, 1], [0, 1]])
    k = sequence_keys(ids, mask, prompt, pmask)
    assert k[0] == k[1] and len(k[0]) == 16
    assert sequence_keys(ids, mask, torch.tensor([[0, 4], [0, 3]]), pmask)[0] != k[0]  # the prompt is in the key
    assert sequence_keys(ids[:, :3], mask[:, :3], prompt[:, 1:], pmask[:, 1:]) == k  # padding is not
    # the definition: BLAKE2b-64 of the prompt's active length, then both active id lists, as little-endian int64
    assert k[0] == hashlib.blake2b(struct.pack("<5q", 1, 3, 5, 6, 7), digest_size=8).hexdigest()
    # where the prompt ends is part of it: ([3], [5, 6]) is not ([3, 5], [6])
    two = sequence_keys(torch.tensor([[5, 6], [6, 0]]), torch.tensor([[1, 1], [1, 0]]), torch.tensor([[3, 0], [3, 5]]),
                        torch.tensor([[1, 0], [1, 1]]))
    assert two[0] != two[1]


def _batch(seed: int, B: int = 8, T: int = 6, H: int = 16, V: int = 40) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    return dict(hidden=torch.randn(B, T, H, generator=g) * 2, weight=torch.randn(V, H, generator=g) * 0.3,
                ids=torch.randint(0, V, (B, T), generator=g), old=-torch.rand(B, T, generator=g) * 3 - 2,
                rewards=torch.randn(B, generator=g), mask=mask, prompt=torch.randint(0, V, (B, 3), generator=g))


def record_run(folder: Path, steps: int = 3, op_at: dict | None = None, micro: int = 1) -> None:
    """A run of the fused linear loss: `steps` steps over the same 8 sequences in `micro` micro-batches (the
    hidden states change by step), with a planted op at the steps `op_at` names."""
    rec = TrainingRecorder(folder, metadata={"world_size": 1, "gradient_accumulation_steps": micro,
                                             "per_device_train_batch_size": 8 // micro})
    for step in range(1, steps + 1):
        b = _batch(step)
        size = 8 // micro
        for m in range(micro):
            s = slice(m * size, (m + 1) * size)
            h = b["hidden"][s].clone().requires_grad_(True)
            kw = dict(completion_mask=b["mask"][s], advantages=b["rewards"][s], beta=0.0, kernels="torch")
            with planted(bool(op_at and step in op_at)):
                res = linear_grpo_loss(h, b["weight"], b["ids"][s], b["old"][s], None, **kw)
            rec.record(res, step=step, input=h, completion_ids=b["ids"][s], completion_mask=b["mask"][s],
                       prompt_ids=b["prompt"][s], old_logps=b["old"][s], micro_batch=m)
            res.loss.backward()
    rec.close()


@contextlib.contextmanager
def planted(on: bool = True):
    """The harness's planted drift (the regrouped token sum) in every fused linear loss while `on`."""
    if not on:
        yield
        return
    with mock.patch.object(LinearGRPOLossOp, "_token_sum", staticmethod(RegroupedLinearOp._token_sum)):
        yield


def test_recorded_run_reads_back_with_its_bits(tmp_path):
    record_run(tmp_path / "a", micro=2)
    df, meta = read_training_run(tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a" / "rank-00000").iterdir()) == [
        "step-0000001.parquet", "step-0000002.parquet", "step-0000003.parquet"]
    assert meta["steps"] == 3 and meta["ranks"] == [0] and meta["metadata"]["gradient_accumulation_steps"] == 2
    seq = df[df["field"] == "per_sequence_policy"]
    assert len(seq) == 24 and seq.groupby("step")["sequence"].nunique().eq(8).all()
    # the values are the loss's: step 1's micro-batch 0 again, compared as bit patterns
    b = _batch(1)
    res = linear_grpo_loss(b["hidden"][:4], b["weight"], b["ids"][:4], b["old"][:4], None,
                           completion_mask=b["mask"][:4], advantages=b["rewards"][:4], beta=0.0, kernels="torch")
    keys = sequence_keys(b["ids"][:4], b["mask"][:4], b["prompt"][:4])
    got = seq[seq["step"] == 1].set_index("sequence").loc[keys, "bits"].tolist()
    assert got == res.per_sequence_policy.view(torch.int32).tolist()
    assert set(df[df["step"] == 1]["field"]) == {"loss", "policy_loss", "kl", "per_sequence_policy", "per_sequence_kl",
                                                "advantages", "per_sequence_active_tokens", "input_digest",
                                                "logps_digest", "grad_digest", "grad_mantissa_digest"}


def test_same_run_is_identical_and_a_planted_loss_change_is_named(tmp_path):
    record_run(tmp_path / "a")
    record_run(tmp_path / "b")
    record_run(tmp_path / "planted", op_at={2})
    same = training_comparison(str(tmp_path / "a"), str(tmp_path / "b"))
    assert same["first"] is None and same["diffs"].empty
    c = training_comparison(str(tmp_path / "a"), str(tmp_path / "planted"))
    assert c["first"] == 2
    v = c["verdicts"]
    assert set(v["step"]) == {2} and set(v["cause"]) == {"loss"} and len(v) > 0
    assert (v["max_ulp"] > 0).all()
    proc = subprocess.run([sys.executable, "-m", "harness", "diff", str(tmp_path / "a"), str(tmp_path / "planted")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "first step where anything moved: 2" in proc.stdout and "0 upstream of the loss" in proc.stdout
    assert "FAILED: the runs differ from step 2 on" in proc.stdout


def test_upstream_and_missing_sequences_are_told_apart(tmp_path):
    record_run(tmp_path / "a")
    rec = TrainingRecorder(tmp_path / "b")  # step 2's hidden states of sequence 0 moved, sequence 7 of step 3 dropped
    for step in range(1, 4):
        b = _batch(step)
        if step == 2:
            b["hidden"][0, 0, 0] = torch.nextafter(b["hidden"][0, 0, 0], torch.tensor(1e9))
        n = 7 if step == 3 else 8
        h = b["hidden"][:n].clone().requires_grad_(True)
        res = linear_grpo_loss(h, b["weight"], b["ids"][:n], b["old"][:n], None, completion_mask=b["mask"][:n],
                               advantages=b["rewards"][:n], beta=0.0, kernels="torch")
        rec.record(res, step=step, input=h, completion_ids=b["ids"][:n], completion_mask=b["mask"][:n],
                   prompt_ids=b["prompt"][:n], old_logps=b["old"][:n])
        res.loss.backward()
    rec.close()
    c = training_comparison(str(tmp_path / "a"), str(tmp_path / "b"))
    steps = c["steps"].set_index("step")
    assert c["first"] == 2
    assert c["verdicts"][c["verdicts"]["step"] == 2]["cause"].tolist() == ["upstream"]
    assert steps.loc[3, "only_in_A"] == 1 and steps.loc[3, "only_in_B"] == 0
    assert not c["scalars"] or steps.loc[3, "scalar_moved"]


def test_a_tampered_step_file_is_refused_in_one_line(tmp_path):
    record_run(tmp_path / "a")
    path = tmp_path / "a" / "rank-00000" / "step-0000002.parquet"
    table = pq.read_table(path)
    df = table.to_pandas()
    df.loc[df["field"] == "per_sequence_kl", "value"] += 1.0
    pq.write_table(table.from_pandas(df, schema=table.schema, preserve_index=False), path)
    proc = subprocess.run([sys.executable, "-m", "harness", "diff", str(tmp_path / "a"), str(tmp_path / "a")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "value vs bits" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    with pytest.raises(TableError, match="value vs bits"):
        read_training_run(tmp_path / "a")


def test_recorder_refuses_bad_calls(tmp_path):
    record_run(tmp_path / "a", steps=1)
    with pytest.raises(ValueError, match="record_dir: expected a new folder"):
        TrainingRecorder(tmp_path / "a")
    with pytest.raises(ValueError, match="rank: expected an int >= 0, got -1"):
        TrainingRecorder(tmp_path / "b", rank=-1)
    rec = TrainingRecorder(tmp_path / "b")
    b = _batch(0)
    res = linear_grpo_loss(b["hidden"], b["weight"], b["ids"], b["old"], None, completion_mask=b["mask"],
                           advantages=b["rewards"], beta=0.0, kernels="torch")
    args = dict(input=b["hidden"], completion_ids=b["ids"], completion_mask=b["mask"])
    rec.record(res, step=3, **args)
    with pytest.raises(ValueError, match="step: expected at least the last recorded step 3, got 2"):
        rec.record(res, step=2, **args)
    with pytest.raises(ValueError, match=r"sequences: expected \(lo, hi\) with hi - lo = 8"):
        rec.record(res, step=3, sequences=(1, 8), **args)
    with pytest.raises(ValueError, match="micro_batch: expected an int >= 0"):
        rec.record(res, step=3, micro_batch=-1, **args)
    with pytest.raises(ValueError, match=r"input: expected \[B, T, ...\] with \[B, T\] = \[8, 6\] like "
                                         r"completion_mask, got \[8, 5, 16\]"):
        rec.record(res, step=3, **{**args, "input": b["hidden"][:, :5]})


def test_a_long_run_reads_and_diffs_in_seconds(tmp_path):
    """1,000 steps x 64 sequences, written as the recorder writes them (one file per step): the time is printed,
    not asserted."""
    import pyarrow as pa
    from grpo_core.recorder import schema
    rng = torch.Generator().manual_seed(0)
    keys = [f"{i:016x}" for i in range(64)]
    folder = tmp_path / "long" / "rank-00000"
    folder.mkdir(parents=True)
    meta = {b"grpo_core": b'{"kind": "training", "rank": 0, "metadata": {}}'}
    for step in range(1, 1001):
        vals = torch.randn(64, generator=rng)
        rows = [dict(step=step, sequence=k, field="per_sequence_policy", value=float(v),
                     bits=int(v.view(torch.int32)), digest=None, generation=0, micro_batch=0, rank=0, order=i)
                for i, (k, v) in enumerate(zip(keys, vals))]
        rows += [dict(step=step, sequence=k, field="input_digest", value=None, bits=None, digest="0" * 32,
                      generation=0, micro_batch=0, rank=0, order=64 + i) for i, k in enumerate(keys)]
        pq.write_table(pa.Table.from_pylist(rows, schema=schema()).replace_schema_metadata(meta),
                       folder / f"step-{step:07d}.parquet")
    start = time.monotonic()
    c = training_comparison(str(tmp_path / "long"), str(tmp_path / "long"))
    print(f"1000 steps x 64 sequences (128,000 rows a run): read twice and compared in "
          f"{time.monotonic() - start:.1f} s")
    assert c["first"] is None and len(c["steps"]) == 1000 and c["steps"]["sequences"].eq(64).all()



def test_a_rank_records_its_own_sequences_of_a_whole_batch_result(tmp_path):
    """The contract path's result covers the whole batch on every DP rank: `sequences=(lo, hi)` picks this rank's."""
    b = _batch(4)
    res = linear_grpo_loss(b["hidden"], b["weight"], b["ids"], b["old"], None, completion_mask=b["mask"],
                           advantages=b["rewards"], beta=0.0, kernels="torch")
    rec = TrainingRecorder(tmp_path / "r", rank=1)
    rec.record(res, step=1, input=b["hidden"][4:], completion_ids=b["ids"][4:], completion_mask=b["mask"][4:],
               prompt_ids=b["prompt"][4:], sequences=(4, 8))
    rec.close()
    df, meta = read_training_run(tmp_path / "r")
    assert meta["ranks"] == [1]
    got = df[df["field"] == "per_sequence_kl"].set_index("sequence").loc[
        sequence_keys(b["ids"][4:], b["mask"][4:], b["prompt"][4:]), "bits"].tolist()
    assert got == res.per_sequence_kl[4:].view(torch.int32).tolist()


def _one_call(seed: int = 0) -> tuple[dict, object, dict]:
    b = _batch(seed)
    res = linear_grpo_loss(b["hidden"], b["weight"], b["ids"], b["old"], None, completion_mask=b["mask"],
                           advantages=b["rewards"], beta=0.0, kernels="torch")
    return b, res, dict(input=b["hidden"], completion_ids=b["ids"], completion_mask=b["mask"])


def test_recorder_refuses_misshapen_side_tensors(tmp_path):
    """A tensor beside the batch that does not fit it is refused by name, never truncated or broadcast."""
    b, res, args = _one_call()
    rec = TrainingRecorder(tmp_path / "r")
    bad = [(dict(prompt_ids=b["prompt"][:3]), r"prompt_ids: expected \[B, P\] with B = 8 like completion_mask, "
                                              r"got \[3, 3\]"),
           (dict(prompt_ids=b["prompt"], prompt_mask=torch.ones(8, 2)), r"prompt_mask: expected the shape of "
                                                                        r"prompt_ids, \[8, 3\], got \[8, 2\]"),
           (dict(old_logps=b["old"][:, :3]), r"old_logps: expected \[B, T\] = \[8, 6\] like completion_mask, got "
                                             r"\[8, 3\]"),
           (dict(ref_logps=b["old"][..., None]), r"ref_logps: expected \[B, T\] = \[8, 6\]"),
           (dict(importance_sampling_ratio=torch.ones(8)), r"importance_sampling_ratio: expected \[B, T\] = \[8, 6\] "
                                                           r"or \[B, 1\] like completion_mask, got \[8\]"),
           (dict(sequences=(-1, 7)), r"sequences: .* and 0 <= lo <= hi <= 8 \(the result's sequences\), got"),
           (dict(sequences=(0.0, 8.0)), r"sequences: expected \(lo, hi\)"),
           (dict(completion_ids=b["ids"].float()), r"completion_ids: expected integer token ids, got torch.float32"),
           (dict(completion_mask=b["mask"][0]), r"completion_mask: expected \[B, T\], got \[6\]")]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            rec.record(res, step=1, **{**args, **kw})
    # B == T: a [B] vector would broadcast along T without a word
    sq = _batch(1, B=6, T=6)
    sq_res = linear_grpo_loss(sq["hidden"], sq["weight"], sq["ids"], sq["old"], None, completion_mask=sq["mask"],
                              advantages=sq["rewards"], beta=0.0, kernels="torch")
    with pytest.raises(ValueError, match=r"old_logps: expected \[B, T\] = \[6, 6\] like completion_mask, got \[6\]"):
        rec.record(sq_res, step=1, input=sq["hidden"], completion_ids=sq["ids"], completion_mask=sq["mask"],
                   old_logps=sq["old"][:, 0])
    # a result that covers more sequences than were given, without `sequences`: whose values are these?
    with pytest.raises(ValueError, match=r"sequences: expected \(lo, hi\) with hi - lo = 4"):
        rec.record(res, step=1, input=b["hidden"][4:], completion_ids=b["ids"][4:], completion_mask=b["mask"][4:])
    rec.record(res, step=1, importance_sampling_ratio=torch.ones(8, 1), **args)  # sequence-level: [B, 1]
    assert rec.flush() is not None
    with pytest.raises(ValueError, match=r"metadata: expected values that JSON can write"):
        TrainingRecorder(tmp_path / "m", metadata={"dtype": torch.bfloat16})


def test_a_written_step_is_never_replaced(tmp_path):
    b, res, args = _one_call()
    rec = TrainingRecorder(tmp_path / "r")
    rec.record(res, step=1, **args)
    written = rec.flush()
    before = written.read_bytes()
    with pytest.raises(ValueError, match="step: expected more than 1, the last written step, got 1"):
        rec.record(res, step=1, micro_batch=1, **args)
    # two recorders of one rank in one folder: the second one's step is refused, the first one's kept
    first, second = TrainingRecorder(tmp_path / "two"), TrainingRecorder(tmp_path / "two")
    first.record(res, step=1, **args)
    second.record(res, step=1, micro_batch=1, **args)
    first.close()
    with pytest.raises(ValueError, match="record_dir: expected no other recorder of rank 0"):
        second.close()
    assert (tmp_path / "two" / "rank-00000" / "step-0000001.parquet").read_bytes() == before


def test_a_field_recorded_in_one_run_only_is_a_difference(tmp_path):
    """Run B ran no backward (no gradient digests) and gave no old log-probs: not identical, and which fields."""
    for name, full in (("a", True), ("b", False)):
        b = _batch(1)
        h = b["hidden"].clone().requires_grad_(True)
        res = linear_grpo_loss(h, b["weight"], b["ids"], b["old"], None, completion_mask=b["mask"],
                               advantages=b["rewards"], beta=0.0, kernels="torch")
        rec = TrainingRecorder(tmp_path / name)
        rec.record(res, step=1, input=h, completion_ids=b["ids"], completion_mask=b["mask"], prompt_ids=b["prompt"],
                   old_logps=b["old"] if full else None)
        if full:
            res.loss.backward()
        rec.close()
    c = training_comparison(str(tmp_path / "a"), str(tmp_path / "b"))
    assert c["first"] == 1
    assert c["steps"].loc[0, ["sequences", "moved", "upstream", "only_in_A", "only_in_B"]].tolist() == [8, 8, 8, 0, 0]
    assert set(c["verdicts"]["fields"]) == {"grad_digest,grad_mantissa_digest,logps_digest"}
    assert "logps_digest (missing in B)" in format_moved(c["verdicts"], c["diffs"])


def test_runs_of_different_lengths(tmp_path):
    """A has steps 1-3, B steps 1-5: steps 4 and 5 are in one run only, nothing moved, no scalar moved."""
    record_run(tmp_path / "a", steps=3)
    record_run(tmp_path / "b", steps=5)
    c = training_comparison(str(tmp_path / "a"), str(tmp_path / "b"))
    steps = c["steps"].set_index("step")
    assert c["first"] == 4 and c["verdicts"].empty
    assert steps["only_in_B"].tolist() == [0, 0, 0, 8, 8] and not steps["scalar_moved"].any()
    text = verdict_text(c)
    assert "first step where anything moved: 4" in text and "a per-call scalar moved" not in text
    assert "a per-call scalar in one run only" in text


def test_listing_every_moved_sequence_of_a_long_run_is_quick():
    """`reports drift` attributes and lists every moved sequence: 1,000 steps x 64 sequences that all moved upstream
    (a run after its weights moved), attributed and listed in full (the time is printed, not asserted)."""
    n = 64_000
    steps, seqs = np.repeat(np.arange(1, 1001), 64), np.tile([f"{i:016x}" for i in range(64)], 1000)
    fields = ["input_digest", "per_sequence_policy"]
    diffs = pd.DataFrame({"step": np.repeat(steps, 2), "sequence": np.repeat(seqs, 2), "occurrence": 0,
                          "field": np.tile(fields, n), "ulp": np.tile([np.nan, 3.0], n), "missing": "",
                          "in_one_run": False})
    verdicts = pd.DataFrame({"step": steps, "sequence": seqs, "occurrence": 0, "fields": ",".join(fields),
                             "cause": "upstream", "first_module": "", "max_ulp": 3.0})
    start = time.monotonic()
    assert sequence_verdicts(diffs).equals(verdicts)
    lines = format_moved(verdicts, diffs, limit=10**9).splitlines()
    print(f"64,000 moved sequences attributed and listed in {time.monotonic() - start:.1f} s")
    assert len(lines) == n and lines[-1] == (f"  step 1000 sequence {63:016x}#0: upstream (input_digest, "
                                             f"per_sequence_policy 3 ULP)")


def test_damaged_metadata_and_a_report_folder_that_is_a_file(tmp_path, capsys):
    record_run(tmp_path / "a", steps=1)
    path = tmp_path / "a" / "rank-00000" / "step-0000001.parquet"
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[b"grpo_core"])
    for bad in ([0], {**meta, "metadata": [1, 2]}):
        pq.write_table(table.replace_schema_metadata({b"grpo_core": json.dumps(bad).encode()}), path)
        with pytest.raises(TableError, match="metadata: .* expected a JSON object"):
            read_training_run(tmp_path / "a")
    pq.write_table(table, path)
    from reports.__main__ import main
    (tmp_path / "file").write_text("")
    assert main(["drift", str(tmp_path / "a"), str(tmp_path / "a"), "--out", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out: expected a folder for the report, got" in err


def test_per_step_figure_of_one_step_and_of_nothing_moved():
    from reports.drift import per_step_figure
    steps = pd.DataFrame({"step": [7], "sequences": [8], "moved": [0], "upstream": [0], "loss": [0], "scale": [0],
                          "gradient": [0], "max_ulp": [0], "only_in_A": [0], "only_in_B": [0], "scalar_moved": [False]})
    fig = per_step_figure(steps)
    fig.canvas.draw()
    ticks = fig.axes[1].get_xticks()
    ticks = ticks[(ticks >= fig.axes[1].get_xlim()[0]) & (ticks <= fig.axes[1].get_xlim()[1])]
    assert list(ticks) == [7.0]  # an optimizer step is an integer
    assert fig.axes[0].get_ylim()[0] == 0 and fig.axes[1].get_ylim()[0] == 0  # no negative count on the axes
    assert all(float(t).is_integer() for ax in fig.axes for t in ax.get_yticks())


def test_token_level_advantages_that_moved_are_upstream(tmp_path):
    """Advantages given per token ([B, T]) are what the loss was given: when they move, the cause is upstream, never
    the loss computation."""
    for name in ("a", "b"):
        b = _batch(2)
        adv = b["rewards"][:, None].expand(8, 6).clone()
        if name == "b":
            adv[3, 0] = torch.nextafter(adv[3, 0], torch.tensor(1e9))
        h = b["hidden"].clone().requires_grad_(True)
        res = linear_grpo_loss(h, b["weight"], b["ids"], b["old"], None, completion_mask=b["mask"], advantages=adv,
                               beta=0.0, kernels="torch")
        rec = TrainingRecorder(tmp_path / name)
        rec.record(res, step=1, input=h, completion_ids=b["ids"], completion_mask=b["mask"], prompt_ids=b["prompt"])
        res.loss.backward()
        rec.close()
    c = training_comparison(str(tmp_path / "a"), str(tmp_path / "b"))
    assert c["verdicts"]["cause"].tolist() == ["upstream"] and "logps_digest" in c["verdicts"]["fields"].iloc[0]


def test_a_path_that_is_no_training_run_is_named_as_the_command_line_names_it(tmp_path):
    from harness.cli import UsageError
    record_run(tmp_path / "a", steps=1)
    (tmp_path / "empty").mkdir()
    for b, why in (("nowhere", "does not exist"), ("empty", "no rank-*/step-*.parquet in it")):
        got = re.escape(f"{tmp_path / b} ({why})")
        with pytest.raises(UsageError, match=f"^RUN_B: expected a training run .* got {got}$"):
            training_comparison(str(tmp_path / "a"), str(tmp_path / b))


def test_an_input_tensor_used_at_every_step_is_digested_once_a_backward(tmp_path):
    """A leaf the user feeds at every step (a benchmark's fixed hidden states): each backward digests its own call's
    gradient, not every earlier call's again."""
    from grpo_core import recorder
    b = _batch(0)
    h = b["hidden"].clone().requires_grad_(True)
    rec = TrainingRecorder(tmp_path / "r")
    digested = []
    call = recorder.RowDigests.__call__
    with mock.patch.object(recorder.RowDigests, "__call__", lambda self, *xs: digested.extend(xs) or call(self, *xs)):
        for step in range(1, 5):
            res = linear_grpo_loss(h, b["weight"], b["ids"], b["old"], None, completion_mask=b["mask"],
                                   advantages=b["rewards"], beta=0.0, kernels="torch")
            digested.clear()
            rec.record(res, step=step, input=h, completion_ids=b["ids"], completion_mask=b["mask"])
            res.loss.backward()
            assert len(digested) == 3  # the input, the gradient, the gradient's mantissas
    rec.close()
    df, _ = read_training_run(tmp_path / "r")
    assert df.groupby("step")["field"].apply(lambda f: (f == "grad_digest").sum()).tolist() == [8, 8, 8, 8]


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_file_holds_the_bits_the_device_gave_however_it_was_written(tmp_path, device):
    """Step 1 is written in the background (step 2's first record hands it off), step 2 at `close`; on a GPU the
    numbers leave the device in one copy into pinned memory, the prompt ids (kept on the host) apart. Every value's
    bits, every digest and every key in the files are those of the tensors the loss and its backward gave."""
    rec, want = TrainingRecorder(tmp_path / "r"), {}
    for step in (1, 2):
        b = _batch(step)
        for m, s in enumerate((slice(0, 5), slice(5, 8))):
            h = b["hidden"][s].to(device).requires_grad_(True)
            dev = {k: b[k][s].to(device) for k in ("ids", "old", "mask", "rewards")}
            res = linear_grpo_loss(h, b["weight"].to(device), dev["ids"], dev["old"], None,
                                   completion_mask=dev["mask"], advantages=dev["rewards"], beta=0.0, kernels="torch")
            rec.record(res, step=step, input=h, completion_ids=dev["ids"], completion_mask=dev["mask"],
                       prompt_ids=b["prompt"][s], old_logps=dev["old"], micro_batch=m)
            res.loss.backward()
            keys = sequence_keys(b["ids"][s], b["mask"][s], b["prompt"][s])
            digests = {"input_digest": h.detach().cpu(), "grad_digest": h.grad.cpu(),
                       "grad_mantissa_digest": mantissas(h.grad.cpu()), "logps_digest": b["old"][s][..., None]}
            for f, x in digests.items():
                want.update({(step, k, f): "".join(f"{v:08x}" for v in d)
                             for k, d in zip(keys, row_digests(x, b["mask"][s]).tolist())})
            for f in ("per_sequence_policy", "per_sequence_kl", "advantages", "per_sequence_active_tokens"):
                t = getattr(res, f).cpu()
                want.update({(step, k, f): v for k, v in zip(keys, (t if t.dtype == torch.int64 else
                                                                    t.view(torch.int32)).tolist())})
            for f in ("loss", "policy_loss", "kl"):
                want[(step, f"rank0/micro-batch{m}", f)] = getattr(res, f).detach().float().cpu().view(torch.int32).item()
    rec.close()
    df, _ = read_training_run(tmp_path / "r")
    got = {(r.step, r.sequence, r.field): r.digest if r.field.endswith("digest") else r.bits for r in df.itertuples()}
    assert got == want


def test_a_background_write_is_of_the_step_as_it_was_and_its_error_is_raised_next(tmp_path):
    """The step handed off is a copy: token ids changed in place before the writer reads them do not reach the file.
    A write that fails in the background raises at the next flush, and the next steps are written."""
    from grpo_core import recorder
    b, res, args = _one_call()
    ids = args["completion_ids"].clone()
    rec, go = TrainingRecorder(tmp_path / "r"), threading.Event()
    keys = recorder.sequence_keys
    with mock.patch.object(recorder, "sequence_keys", lambda *a: go.wait(10) and keys(*a)):
        rec.record(res, step=1, **{**args, "completion_ids": ids})
        rec.flush(wait=False)
        ids += 1  # the trainer reuses its buffer while the writer waits
        go.set()
        rec.close()
    df, _ = read_training_run(tmp_path / "r")
    assert set(df["sequence"]) - {"rank0/micro-batch0"} == set(sequence_keys(args["completion_ids"], args[
        "completion_mask"]))
    with mock.patch.object(pq, "write_table", side_effect=OSError("disk full")):
        rec.record(res, step=2, **args)
        rec.flush(wait=False)
        with pytest.warns(RuntimeWarning, match=r"step 2 was not written \(OSError: disk full\)"), \
                pytest.raises(OSError, match="disk full"):
            rec.record(res, step=3, **args)  # a new step waits for the last write: its error
        rec.record(res, step=3, **args)
        with pytest.raises(OSError, match="disk full"):
            rec.flush()  # written at once: the step stays, to be flushed again
    rec.close()
    assert sorted(p.name for p in (tmp_path / "r" / "rank-00000").iterdir()) == ["step-0000001.parquet",
                                                                                "step-0000003.parquet"]


def test_runs_keyed_in_other_formats_are_not_compared(tmp_path):
    """A run whose files name another key format (or none: an earlier recorder's) cannot be matched sequence by
    sequence: the diff says so instead of reporting every sequence in one run only."""
    from harness.cli import UsageError
    for name in ("a", "b"):
        record_run(tmp_path / name, steps=2)
    for path in (tmp_path / "b").glob("rank-*/step-*.parquet"):
        table = pq.read_table(path)
        meta = json.loads(table.schema.metadata[b"grpo_core"])
        del meta["sequence_keys"]
        pq.write_table(table.replace_schema_metadata({b"grpo_core": json.dumps(meta).encode()}), path)
    with pytest.raises(UsageError, match=r"^RUN_B: expected sequence keys of RUN_A's format, blake2b-64\(int64le: "
                                         r"prompt length, prompt ids, completion ids\), got none named \(an earlier "
                                         r"recorder's JSON token lists\)"):
        training_comparison(str(tmp_path / "a"), str(tmp_path / "b"))
